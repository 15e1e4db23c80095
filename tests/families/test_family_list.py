"""The family list (jaxfuse/_optim/families): every family registered with its functions and
variants, the shared options spelled alike in every signature and documented once."""

import inspect

import pytest

import jaxfuse
from jaxfuse._optim import families
from jaxfuse._optim.families.lion import LionSpec


def test_every_public_optimizer_is_registered():
  """Every public function that builds a jaxfuse optimizer (it takes master_weights) is in the
  list, once, with at least one variant, or declared a composite of families (jaxfuse.muon)."""
  registered = [f for family in families.registered() for f in family.functions]
  registered += families.composites()
  public = [getattr(jaxfuse, name) for name in jaxfuse.__all__
            if callable(getattr(jaxfuse, name)) and not inspect.isclass(getattr(jaxfuse, name))
            and "master_weights" in inspect.signature(getattr(jaxfuse, name)).parameters]
  assert sorted(f.__name__ for f in registered) == sorted(f.__name__ for f in public)
  assert all(family.variants for family in families.registered())


def test_options_documented_once_in_every_function():
  for functions in [family.functions for family in families.registered()] + [
      families.composites()]:
    for fn in functions:
      doc = fn.__doc__
      if "\n  Args:\n" in doc:
        for option in families.OPTION_DOCS:
          if option in inspect.signature(fn).parameters:
            assert doc.count(f"\n    {option}: ") == 1, (fn.__name__, option)


def test_an_option_spelled_differently_is_refused_at_declaration():
  def odd(learning_rate, *, seed=0):  # the Spec's default is None
    """A family function whose seed defaults differently."""

  with pytest.raises(TypeError, match="odd: the option seed must be keyword-only with the "
                                      "default None"):
    families.family(LionSpec)(odd)

  def positional(learning_rate, skip_nonfinite=False):
    """A family function whose option is positional."""

  with pytest.raises(TypeError, match="skip_nonfinite must be keyword-only"):
    families.family(LionSpec)(positional)
