#!/usr/bin/env bash
# The CPU handlers under AddressSanitizer + UndefinedBehaviorSanitizer: builds the extension in
# Debug (asserts on, -O0) with both sanitizers into build/dev-sanitize and runs the test suite
# against it, less the tests marked slow (hundreds of leaves, a large tensor: they stress XLA's
# compiler, whose allocations ASan slows tenfold), tests/test_cuda_on_cpu.py (which
# tools/cuda_on_cpu.sh runs against this build), tests/test_dtypes.py, tests/test_frameworks.py,
# tests/test_optax_suite.py, tests/test_generate.py, tests/test_hf.py, tests/test_prefill.py,
# tests/test_readme.py, tests/test_build.py, tests/test_report.py, tests/test_sharding.py,
# tests/test_kernel_report.py, the optimizer families' own files (tests/families/),
# tests/test_precision.py, tests/test_moments8.py, tests/test_fused.py, tests/test_muon.py,
# tests/test_first_use.py, tests/test_install.py, test_faults.py's checkpoint round trips and
# most of tests/test_quantize.py's reference matrix.
# Exit status 0 when every test passes with no sanitizer report.
#   bash tools/sanitize.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
source tools/dev_build.sh
BUILD=build/dev-sanitize
echo "== sanitize: build ($BUILD)"
dev_build "$BUILD" .
echo "== sanitize: test suite against the sanitized CPU handlers"
# tests/test_cuda_on_cpu.py runs against this same build in tools/cuda_on_cpu.sh;
# tests/test_frameworks.py trains with flax/equinox through the handlers test_adam.py and
# test_fused.py already cover here, and tests/test_optax_suite.py runs optax's own tests on the
# optax protocol, which is XLA's math (its one jaxfuse call, the norm, test_clip.py covers): both
# mostly cost compile time; so does tests/test_dtypes.py, whose handler calls on mixed-dtype trees
# tools/cuda_on_cpu.sh makes under this build too (and whose eager optax-protocol cases call no
# jaxfuse handler at all). tests/test_generate.py drives the decoder handler through generation
# loops (the handler's cases, out-of-range rows included, are test_decoder.py's) and
# tests/test_hf.py is Python (the checkpoint loader) and plain XLA, as is the prefill
# (tests/test_prefill.py; its one decode step is test_decoder.py's); tests/test_readme.py runs the
# documentation's examples, whose calls the op tests cover; tests/test_build.py configures CMake
# and tests/test_kernel_report.py judges made-up kernels (both call no handler);
# tests/test_report.py and tests/test_sharding.py compile steps whose handler calls (on whole
# arrays, or on each device's shard) the op tests make too. Every family's CPU handlers (each state
# layout, master weights, remainders, stochastic rounding, 8-bit states, the trust sums) run under
# this build in tools/cuda_on_cpu.sh, beside the emulated CUDA ones, on mixed dtypes and sizes; the
# conformance suite (tests/families/) adds the optax comparisons and options, which differ in math
# and Python, not in what the driver does with memory.
# tests/test_quantize.py's kernel-against-reference matrix does not run here (its int8 / fp8 cases
# across splits are tests/test_decoder.py's, which do): the int8 / fp8 decoder handlers run under
# this build in tools/cuda_on_cpu.sh (every kernel instance, against the emulated CUDA ones), and
# the matrix is most of this pass's time under ASan.
# Adam's several-call comparison, the clip + AdamW chain, the
# decoder's architecture features and the whole step with a quantized head run their CPU
# handlers under this build in tools/cuda_on_cpu.sh too (the emulated cases' references: odd
# sizes, mixed dtypes, 301 leaves in two calls, the folded clip, biases, q/k norms and scaled
# RoPE, the int8 head); here they would be most of its time.
# tests/test_fused.py composes the in-place step (chains, gradient accumulation, skips) from the
# handler calls test_adam.py and test_clip.py make here, and tools/cuda_on_cpu.sh steps
# fused_step in every mode under this build. tests/test_muon.py's handler calls (Muon's element
# pass beside AdamW's, master weights) run under this build in tools/cuda_on_cpu.sh too; the rest
# of it is Newton-Schulz in XLA. tests/test_first_use.py and tests/test_install.py check Python's
# messages, the donation check and how the modules load (their handler calls are Adam steps that
# tests/test_adam.py makes here), and test_faults.py's checkpoint round trips add serialization to
# the steps its other cases run here.
if [ $# -eq 0 ]; then
  keep="not test_kernel_matches_reference"
  keep+=" and not test_whole_model_step_with_quantized_head"
  keep+=" and not test_unclipped_chain_matches_optax and not test_architecture_features"
  keep+=" and not test_fused_step_over_several_calls"
  keep+=" and not test_restored_run_is_bitwise_the_uninterrupted_run"
  set -- tests -n auto -m "not slow" --ignore=tests/test_cuda_on_cpu.py \
    --ignore=tests/test_dtypes.py --ignore=tests/test_first_use.py --ignore=tests/test_install.py \
    --ignore=tests/test_frameworks.py --ignore=tests/test_optax_suite.py \
    --ignore=tests/test_generate.py --ignore=tests/test_hf.py --ignore=tests/test_prefill.py \
    --ignore=tests/test_readme.py --ignore=tests/test_build.py --ignore=tests/test_report.py \
    --ignore=tests/test_sharding.py --ignore=tests/test_kernel_report.py \
    --ignore=tests/families --ignore=tests/test_precision.py --ignore=tests/test_moments8.py \
    --ignore=tests/test_fused.py --ignore=tests/test_muon.py --ignore=tests/test_lockstep.py \
    -k "$keep"
fi
with_dev_build "$BUILD" python3 -m pytest -q -p no:cacheprovider "$@"
