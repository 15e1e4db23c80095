"""optax's own tests, run against jaxfuse's transforms (see optax_suite.py for how).

Each suite is optax's test file from the installed optax, cut down to the cases that exercise
what jaxfuse replaces, with jaxfuse's function swapped in under optax's name. Cases jaxfuse
fails by design are listed in BY_DESIGN with the reason, and skipped one by one.
"""

import jax
import optax
import pytest

import jaxfuse
import optax_suite
from jaxfuse._optim import families

# The families' public functions that optax ships in its core (its alias module); the others
# (schedule-free) are optax.contrib's, with their own suites below.
OPTIMIZERS = tuple(f.__name__ for family in families.registered() for f in family.functions
                   if hasattr(optax, f.__name__))
SCHEDULE_FREE = {name: getattr(jaxfuse, name) for name in
                 ("schedule_free_adamw", "schedule_free_sgd", "schedule_free_eval_params")}

# optax accepts a mu_dtype that is complex for real params or real for complex ones and casts
# between them later without a word (imaginary parts are dropped); jaxfuse refuses it at init,
# and SGD an accumulator_dtype whose kind (real or complex) differs from the params'.
# (test method as written in optax's source, its exact parameters, why jaxfuse fails it; a
# params_dtype of None is the default float dtype.)
BY_DESIGN = [
    ("test_explicit_dtype", {"params_dtype": params, "state_dtype": state, "opt_name": opt},
     f"jaxfuse refuses a {mu} mu_dtype (accumulator_dtype) for {kind} params (by design)")
    for opt in ("adam", "adamw", "sgd_mom")
    for params, state in [("bfloat16", "complex64"), ("float32", "complex64"), (None, "complex64"),
                          ("complex64", "bfloat16"), ("complex64", "float32")]
    for mu, kind in [("complex", "real") if state == "complex64" else ("real", "complex")]
]


# pytest collects unittest classes under the names they have here. The alias suite takes ~10 s
# on a CPU (test_optimization's 10000 jitted steps are tiny), so it is not marked slow.
# optax's AliasTest for the families jaxfuse fuses, with jaxfuse's transforms as `alias.*` (the
# rest of `alias` stays optax's).
OptaxAliasTest = optax_suite.load(
    "_src/alias_test.py", {"AliasTest": None},
    overrides={"alias": {name: getattr(jaxfuse, name) for name in OPTIMIZERS}},
    filters={"_OPTIMIZERS_UNDER_TEST": optax_suite.keep("opt_name", OPTIMIZERS)}).AliasTest
optax_suite.skip_cases(OptaxAliasTest, BY_DESIGN)

# optax's test of clip_by_global_norm, judged by optax's own optax.tree.norm.
OptaxClippingTest = optax_suite.load(
    "transforms/_clipping_test.py", {"ClippingTest": ["test_clip_by_global_norm"]},
    overrides={"_clipping": {"clip_by_global_norm": jaxfuse.clip_by_global_norm}}).ClippingTest

# optax's global-norm test, with jaxfuse.global_norm as optax.tree.norm.
OptaxLinearAlgebraTest = optax_suite.load(
    "_src/linear_algebra_test.py", {"LinearAlgebraTest": ["test_global_norm"]},
    overrides={"optax": {"tree": {"norm": jaxfuse.global_norm}}}).LinearAlgebraTest

# optax's mixed float32/float64 dtype-preservation test for jaxfuse's transforms. The swap and
# the filter apply before the module body runs: ALL_MODULES captures them at import.
OptaxFloat64Test = optax_suite.load(
    "_src/float64_test.py", {"Float64Test": ["test_mixed_dtype_input_outputs"]},
    overrides={"alias": {"adam": jaxfuse.adam, "adamw": jaxfuse.adamw},
               "transforms": {"clip_by_global_norm": jaxfuse.clip_by_global_norm}},
    filters={"ALL_MODULES": optax_suite.keep(0, {"adam", "adamw", "clip_by_global_norm"})},
).Float64Test

# optax's Muon tests with jaxfuse.muon as `_muon.muon`: the updates, the state's structure (which
# leaves Muon's momentum masks out) and convergence. Its tests of optax's private reshape and
# orthogonalization functions (and their preconditionings' first iterations) stay optax's;
# jaxfuse's batched ones are compared with them in tests/test_muon.py.
OptaxMuonTest = optax_suite.load(
    "contrib/_muon_test.py",
    {"MuonTest": ["test_callable_weight_dim_nums",
                  "test_reshape_update_for_square_parameter_matches_muon_without_dim_nums",
                  "test_reshape_and_update_single_param", "test_dim_nums_combinations",
                  "test_complex_mixed_target", "test_muon_orthogonalization_modes",
                  "test_aol_numerical_difference", "test_orthogonality"]},
    overrides={"_muon": {"muon": jaxfuse.muon}}).MuonTest


# optax's schedule-free tests: jaxfuse's schedule_free_adamw against optax's schedule_free
# wrapper of optax.adamw, learning rate 0, 0-d params, donation of params and z.
OptaxScheduleFreeTest = optax_suite.load(
    "contrib/_schedule_free_test.py", {"ScheduleFreeTest": None},
    overrides={"_schedule_free": SCHEDULE_FREE}).ScheduleFreeTest

# optax's common tests of its contrib optimizers, for the schedule-free ones: convergence
# (evaluated at schedule_free_eval_params), extra args, inject_hyperparams, dtypes and state
# stability, gradient accumulation. Their list is built by code: the other optimizers' cases
# are removed once generated (the base list, a literal, is emptied first).
OptaxContribScheduleFreeTest = optax_suite.load(
    "contrib/_common_test.py", {"ContribTest": None},
    overrides={"contrib": SCHEDULE_FREE},
    filters={"_BASE_OPTIMIZERS": optax_suite.keep("opt_name", ())}).ContribTest
optax_suite.keep_cases(OptaxContribScheduleFreeTest,
                       lambda p: p["opt_name"] in SCHEDULE_FREE and p["wrapper_name"] is None)


@pytest.fixture(autouse=True)
def _restore_x64():
  """optax's Float64Test turns jax_enable_x64 on and only turns it off if it passes; the
  flag is process-wide, so put back whatever it was before each test, pass or fail."""
  previous = jax.config.jax_enable_x64
  yield
  jax.config.update("jax_enable_x64", previous)
