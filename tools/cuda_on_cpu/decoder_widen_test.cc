// The CUDA decoder's 8-bit weight widening (csrc/decoder/cuda/decoder_widen.cuh) on every pair of
// codes, run on the CPU by tools/cuda_on_cpu: each int8 and fp8 e4m3 code (subnormal, zero, the NaN
// codes read as +-480) must come out as the bf16 bits of the value the CPU handlers read, whatever
// the ignored bytes hold, the gathers of the GEMV and the LM head must pair the codes they name,
// and the fp32 widening of the FMA GEMVs must give every code's value in every byte. The emulator's
// bf16 fma computes in double from the bits; on a GPU, with subnormal fp8 codes, tools/gpu_ops.py's
// decoder cases check the same against the CPU handler. Exit status 0 when every check passes.
#include <cstdio>
#include <random>
#include <string>

#include "decoder/cuda/decoder_widen.cuh"

namespace jaxfuse::cuda_decoder {
namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok && ++failures <= 20) std::fprintf(stderr, "FAIL: %s\n", what.c_str());
}

// The bf16 bits of code c of kW, from the CPU handlers' reading (an exact bf16 value).
template <DType kW>
uint32_t expected_bits(uint32_t c) {
  const float v = kW == DType::kI8 ? float(int8_t(c)) : f8e4m3_to_float(uint8_t(c));
  return float_bits(v) >> 16;
}

template <DType kW>
void test_every_pair(const char* name, std::mt19937& rng) {
  for (uint32_t lo = 0; lo < 256; ++lo) {
    for (uint32_t hi = 0; hi < 256; ++hi) {
      const uint32_t ignored = rng() & 0x00ff00ffu;
      const uint32_t got = widen_pair<kW>(lo << 8 | hi << 24 | ignored);
      const uint32_t want = expected_bits<kW>(lo) | expected_bits<kW>(hi) << 16;
      if (got == want) continue;
      char what[96];
      std::snprintf(what, sizeof what, "%s codes (0x%02x, 0x%02x): 0x%08x, want 0x%08x", name, lo,
                    hi, got, want);
      check(false, what);
    }
  }
}

// The GEMV's and the LM head's gathers (widen_rows, widen_word) on random words.
template <DType kW>
void test_gathers(const char* name, std::mt19937& rng) {
  const auto bits = [](uint32_t word, int byte) { return expected_bits<kW>(word >> 8 * byte & 0xffu); };
  const auto pair = [](uint32_t lo, uint32_t hi) { return lo | hi << 16; };
  for (int trial = 0; trial < 1000; ++trial) {
    const uint32_t a = rng(), b = rng();
    uint32_t first, second;
    for (int byte : {0, 2}) {
      widen_rows<kW>(a, b, byte, first, second);
      check(first == pair(bits(a, byte), bits(b, byte)) &&
                second == pair(bits(a, byte + 1), bits(b, byte + 1)),
            std::string(name) + " GEMV gather");
    }
    widen_word<kW>(a, first, second);
    check(first == pair(bits(a, 0), bits(a, 1)) && second == pair(bits(a, 2), bits(a, 3)),
          std::string(name) + " head gather");
  }
}

// The FMA GEMVs' fp32 widening (widen_floats): every code in every byte of a word, the other
// bytes random, to the bits of the CPU handlers' value.
template <DType kW>
void test_floats(const char* name, std::mt19937& rng) {
  for (uint32_t c = 0; c < 256; ++c) {
    for (int byte = 0; byte < 4; ++byte) {
      const uint32_t w = (rng() & ~(0xffu << 8 * byte)) | c << 8 * byte;
      float o[4];
      widen_floats<kW>(w, o);
      for (int i = 0; i < 4; ++i) {
        if (float_bits(o[i]) == expected_bits<kW>(w >> 8 * i & 0xffu) << 16) continue;
        char what[96];
        std::snprintf(what, sizeof what, "%s fp32 widening of word 0x%08x, byte %d: 0x%08x",
                      name, w, i, float_bits(o[i]));
        check(false, what);
      }
    }
  }
}

}  // namespace
}  // namespace jaxfuse::cuda_decoder

int main() {
  using namespace jaxfuse;
  using namespace jaxfuse::cuda_decoder;
  std::mt19937 rng(7);
  test_every_pair<DType::kI8>("int8", rng);
  test_every_pair<DType::kF8E4M3>("fp8", rng);
  test_gathers<DType::kI8>("int8", rng);
  test_gathers<DType::kF8E4M3>("fp8", rng);
  test_floats<DType::kI8>("int8", rng);
  test_floats<DType::kF8E4M3>("fp8", rng);
  std::printf("decoder widening (every int8 and fp8 code pair, the GEMV and head gathers, the "
              "fp32 widening of every code): %s, "
              "%d failures\n", failures ? "FAILED" : "ok", failures);
  return failures ? 1 : 0;
}
