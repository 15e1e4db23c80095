// The CUDA decoder's next-token draw after the LM head (included by cuda/decoder.cu only):
// SampleStage, with top-k and top-p found in the kernel (sampling_math.h's radix passes).
#pragma once

#include "decoder/cuda/decoder_common.cuh"

namespace jaxfuse::cuda_decoder {

// A filtered draw's pass over the logits (SampleStage): counting the candidates' digits
// (top-k), only finding each row's largest score, or counting and weighing them (top-p).
enum class SelectMode { kCount, kMax, kMass };

// A block's shared memory during a filtered draw, in the warp_sums area: one row's histogram of
// the pass (counts, fixed-point masses), then the walk's per-warp sums and target thread.
struct SelectSmem {
  unsigned* counts;                 // [kSelectBins]
  unsigned long long* masses;       // [kSelectBins]
  unsigned* warp_counts;            // [kWarps]
  unsigned long long* warp_masses;  // [kWarps]
  int* target;

  __device__ explicit SelectSmem(Smem& sm)
      : counts(reinterpret_cast<unsigned*>(sm.warp_sums)),
        masses(reinterpret_cast<unsigned long long*>(sm.warp_sums + kSelectBins)),
        warp_counts(reinterpret_cast<unsigned*>(sm.warp_sums + 3 * kSelectBins)),
        warp_masses(reinterpret_cast<unsigned long long*>(sm.warp_sums + 3 * kSelectBins +
                                                          2 * kWarps)),
        target(reinterpret_cast<int*>(sm.warp_sums + 3 * kSelectBins + 4 * kWarps)) {}
};
static_assert(sizeof(Smem::warp_sums) >= (3 * kSelectBins + 4 * kWarps + 1) * 4,
              "the sampling histogram does not fit in warp_sums");
static_assert(kSelectBins % kThreads == 0, "whole bins per thread in a walk");

// The sampling passes' work items: each row's logits in `parts` contiguous parts, as many as the
// grid has blocks for every row (one part a block; a whole row a block when the batch is larger
// than the grid), so a pass costs about one block's share of one row at any batch.
struct RowParts {
  int parts, chunk, items;

  __device__ RowParts(int batch, int vocab)
      : parts(max(1, int(gridDim.x) / batch)), chunk((vocab + parts - 1) / parts),
        items(batch * parts) {}
  __device__ int row(int item) const { return item / parts; }
  __device__ int first(int item) const { return item % parts * chunk; }
};

// f(n, logits[n]) for n in [n0, n1), strided over the block's threads, each thread's
// kLogitGroup logits loaded before any is used (their L2 round trips overlap).
constexpr int kLogitGroup = 8;
template <typename F>
__device__ __forceinline__ void for_logits(const float* logits, int n0, int n1, const F& f) {
  for (int n = n0 + thread_index(); n < n1; n += kThreads * kLogitGroup) {
    float v[kLogitGroup];
#pragma unroll
    for (int g = 0; g < kLogitGroup; ++g) {
      v[g] = n + g * kThreads < n1 ? ws_load(logits + n + g * kThreads) : 0.0f;
    }
#pragma unroll
    for (int g = 0; g < kLogitGroup; ++g) {
      if (n + g * kThreads < n1) f(n + g * kThreads, v[g]);
    }
  }
}

// next_tokens[b] = the argmax over n of row b's sampling scores (sampling_math.h) among those
// top-k and top-p keep: each block scores the logits of its RowParts items, a warp's best goes
// to the row's key by atomicMax (the max of keys does not depend on the order), and the last
// block to finish writes the winners' indices.
//
// A filtered row's floor (the smallest key kept) is found first, by up to kDecSamplePasses
// passes over its logits (sampling_math.h's radix passes: top-k's, a pass for the largest score
// when top-k did not find it, top-p's). In each pass every block counts the candidates of its
// items by digit in shared memory and adds the nonzero bins to the row's histogram in the
// workspace, then arrives on the pass's counter; row b's walk is block b's (mod the grid): once
// every block has arrived it walks the bins, each thread kSelectBins / kThreads of them (a
// suffix sum over the block finds the thread whose bins hold the target), zeroes them for the
// next pass, writes the row's SampleSearch and sets the row's flag of the pass, which the next
// pass waits for before it reads the row. A block arrives only after the flags of the pass
// before, set only after every block arrived there, so on a co-resident grid every wait ends.
struct SampleStage {
  const DecoderParams& p;
  Smem& sm;

  __device__ void run() const {
    const SampleRule rule = p.io.sample_rule(p.dims.temperature, p.dims.top_k, p.dims.top_p);
    int last = -1;  // the last pass run: its row flags mark the rows' floors final
    if (rule.top_k_filters(p.dims.vocab)) {
      for (int pass = 0; pass < kSelectPasses; ++pass) {
        select_pass(rule, SelectMode::kCount, pass, pass, last,
                    pass == 0 && rule.top_p_filters());
        last = pass;
      }
    }
    if (rule.top_p_filters()) {
      if (last < 0) {  // the masses need the largest score, which top-k's first pass finds
        select_pass(rule, SelectMode::kMax, 0, kSelectPasses, last, true);
        last = kSelectPasses;
      }
      for (int pass = 0; pass < kSelectPasses; ++pass) {
        const int q = kSelectPasses + 1 + pass;
        select_pass(rule, SelectMode::kMass, pass, q, last, false);
        last = q;
      }
    }
    draw(rule, last);
  }

  // Pass q (radix pass `pass` of `mode`) over every row, after each row's pass `prev` (-1: none);
  // with_max: also each row's largest key.
  __device__ void select_pass(const SampleRule& rule, SelectMode mode, int pass, int q, int prev,
                              bool with_max) const {
    const RowParts rp(p.dims.batch, p.dims.vocab);
    for (int item = block_index(); item < rp.items; item += gridDim.x) {
      const int b = rp.row(item);
      if (prev >= 0) await_arrivals(p.run.chained, sm.clock, p.ws.select_flag(b, prev), 1);
      const int n0 = rp.first(item);
      histogram(rule, mode, pass, b, n0, min(p.dims.vocab, n0 + rp.chunk), load_search(b),
                with_max);
    }
    arrive(p.ws.select_arrivals(q));
    for (int b = block_index(); b < p.dims.batch; b += gridDim.x) {
      await_arrivals(p.run.chained, sm.clock, p.ws.select_arrivals(q), gridDim.x);
      if (mode != SelectMode::kMax) walk(rule, mode, pass, b);
      __threadfence();  // release: the row's search (and its zeroed bins)
      __syncthreads();
      if (thread_index() == 0) atomicExch(p.ws.select_flag(b, q), 1);
    }
  }

  __device__ SampleSearch load_search(int b) const {
    const SampleSearch* s = p.ws.select_search(b);
    return {__ldcg(&s->prefix), __ldcg(&s->need), __ldcg(&s->max_key), __ldcg(&s->floor),
            __ldcg(&s->above), __ldcg(&s->total)};
  }

  // The candidates among row b's logits [n0, n1) (keys >= st.floor in the bucket of st.prefix)
  // counted (and weighed) by their digit of `pass`, added to the row's histogram.
  __device__ void histogram(const SampleRule& rule, SelectMode mode, int pass, int b, int n0,
                            int n1, const SampleSearch& st, bool with_max) const {
    const SelectSmem h(sm);
    const bool counting = mode != SelectMode::kMax;
    const int bins = select_bins(pass), t = thread_index(), V = p.dims.vocab;
    if (counting) {
      __syncthreads();  // the area's previous readers are done
      for (int i = t; i < bins; i += kThreads) {
        h.counts[i] = 0;
        h.masses[i] = 0;
      }
      __syncthreads();
    }
    const float* logits = p.io.logits + int64_t(b) * V;
    const float max_s = order_value(st.max_key);
    const int shift = mass_shift(V);
    uint32_t largest = 0;
    for_logits(logits, n0, n1, [&](int, float logit) {
      const float s = rule.scaled(logit);
      const uint32_t key = order_key(s);
      largest = max(largest, key);
      if (!counting || key < st.floor || !select_in_bucket(key, st.prefix, pass)) return;
      const uint32_t digit = select_digit(key, pass);
      atomicAdd(h.counts + digit, 1u);
      if (mode == SelectMode::kMass) {
        atomicAdd(h.masses + digit, static_cast<unsigned long long>(fixed_mass(s, max_s, shift)));
      }
    });
    if (with_max) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) largest = max(largest, __shfl_xor_sync(0xffffffffu, largest, o));
      if (t % 32 == 0) atomicMax(&p.ws.select_search(b)->max_key, largest);
    }
    if (!counting) return;
    __syncthreads();
    unsigned* counts = p.ws.select_counts(b);
    unsigned long long* masses = p.ws.select_masses(b);
    for (int i = t; i < bins; i += kThreads) {
      const unsigned c = h.counts[i];
      if (c == 0) continue;
      atomicAdd(counts + i, c);
      if (mode == SelectMode::kMass) atomicAdd(masses + i, h.masses[i]);
    }
  }

  // Row b's walk after pass `pass` (every block has added its bins): the bin that holds the
  // threshold, its digit appended to the row's prefix (the floor after the last pass).
  __device__ void walk(const SampleRule& rule, SelectMode mode, int pass, int b) const {
    constexpr int kPer = kSelectBins / kThreads;
    const SelectSmem h(sm);
    const int t = thread_index(), first = t * kPer, bins = select_bins(pass);
    unsigned* counts = p.ws.select_counts(b);
    unsigned long long* masses = p.ws.select_masses(b);
    const bool weighed = mode == SelectMode::kMass;
    uint32_t c[kPer];
    uint64_t m[kPer];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const bool in = first + u < bins;
      c[u] = in ? __ldcg(counts + first + u) : 0u;
      m[u] = in && weighed ? __ldcg(masses + first + u) : 0ull;
    }
    uint32_t count = 0;
    uint64_t mass = 0;
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      if (first + u < bins) {  // zeroed for the next pass, whose blocks add after the row's flag
        counts[first + u] = 0;
        if (weighed) masses[first + u] = 0;
      }
      count += c[u];
      mass += m[u];
    }
    // Every thread reads the row's search before suffix_sums' barriers, after which one thread
    // rewrites it.
    const SampleSearch st = load_search(b);
    uint32_t count_above;
    uint64_t mass_above, mass_total;
    suffix_sums(h, count, mass, &count_above, &mass_above, &mass_total);
    SampleSearch* out = p.ws.select_search(b);
    const uint32_t base = pass == 0 ? 0u : st.prefix;
    const bool last_pass = pass == kSelectPasses - 1;
    if (mode == SelectMode::kCount) {
      uint32_t need = pass == 0 ? uint32_t(rule.top_k) : st.need;
      if (count_above < need && need <= count_above + count) {
        need -= count_above;
        const uint32_t prefix = base | uint32_t(first + walk_count(c, kPer, need))
                                           << select_shift(pass);
        out->prefix = prefix;
        out->need = need;
        if (last_pass) out->floor = prefix;
      }
      return;
    }
    const uint64_t total = pass == 0 ? mass_total : st.total;
    const NucleusLimit rule_p{double(rule.top_p) * double(total)};
    uint64_t above = (pass == 0 ? 0ull : st.above) + mass_above;
    if (t == 0) *h.target = kThreads;
    __syncthreads();
    if (count > 0 && rule_p.keeps(above)) atomicMin(h.target, t);  // the lowest kept range
    __syncthreads();
    if (t == *h.target) {
      const uint32_t prefix = base | uint32_t(first + walk_mass(c, m, kPer, above, rule_p))
                                         << select_shift(pass);
      out->prefix = prefix;
      out->above = above;
      if (pass == 0) out->total = total;
      if (last_pass) out->floor = prefix;
    }
  }

  // Over the block's threads in order (thread t's bins below thread t + 1's): the count and mass
  // of the bins above this thread's, and the mass of all.
  __device__ static void suffix_sums(const SelectSmem& h, uint32_t count, uint64_t mass,
                                     uint32_t* count_above, uint64_t* mass_above,
                                     uint64_t* mass_total) {
    const int lane = thread_index() % 32, warp = thread_index() / 32;
    unsigned c = count;
    unsigned long long m = mass;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {  // inclusive suffix sums within the warp
      const unsigned oc = __shfl_down_sync(0xffffffffu, c, d);
      const unsigned long long om = __shfl_down_sync(0xffffffffu, m, d);
      if (lane + d < 32) {
        c += oc;
        m += om;
      }
    }
    if (lane == 0) {
      h.warp_counts[warp] = c;
      h.warp_masses[warp] = m;
    }
    __syncthreads();
    uint32_t ca = c - count;
    uint64_t ma = m - mass, total = 0;
    for (int w = 0; w < kWarps; ++w) {
      total += h.warp_masses[w];
      if (w > warp) {
        ca += h.warp_counts[w];
        ma += h.warp_masses[w];
      }
    }
    __syncthreads();  // the sums read before the area is reused
    *count_above = ca;
    *mass_above = ma;
    *mass_total = total;
  }

  // This block's arrival on a pass's counter, once its bins are added.
  __device__ void arrive(int* counter) const {
    __threadfence();
    __syncthreads();
    if (thread_index() == 0) atomicAdd(counter, 1);
  }

  // The draw, rows with a filter once their floor is final (pass `last`'s flags; -1: none).
  __device__ void draw(const SampleRule& rule, int last) const {
    const int V = p.dims.vocab, lane = thread_index() % 32;
    const RowParts rp(p.dims.batch, V);
    for (int item = block_index(); item < rp.items; item += gridDim.x) {
      const int b = rp.row(item), n0 = rp.first(item), n1 = min(V, n0 + rp.chunk);
      uint32_t floor = 0;
      if (last >= 0) {
        await_arrivals(p.run.chained, sm.clock, p.ws.select_flag(b, last), 1);
        floor = __ldcg(&p.ws.select_search(b)->floor);
      }
      const float* logits = p.io.logits + int64_t(b) * V;
      unsigned long long best = 0;
      for_logits(logits, n0, n1, [&](int n, float logit) {
        if (!sample_keeps(rule, logit, floor)) return;
        const unsigned long long key = argmax_key(rule.score(logit, b, n, V), n);
        best = key > best ? key : best;
      });
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
        best = other > best ? other : best;
      }
      if (lane == 0 && best != 0) atomicMax(p.ws.sample_key(b), best);
    }
    if (arrive_last(p.ws.sample_counter(), gridDim.x, &sm.flag)) {
      for (int b = thread_index(); b < p.dims.batch; b += kThreads) {
        p.io.next_tokens[b] = argmax_index(__ldcg(p.ws.sample_key(b)));
      }
    }
  }
};

}  // namespace jaxfuse::cuda_decoder
