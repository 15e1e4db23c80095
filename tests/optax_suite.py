"""Loads optax's own test files from the installed optax package, with jaxfuse swapped in.

optax's tests define "optax-compatible" and change with optax, so they are not copied here: each
file is read from the installed package, cut down to the requested classes and methods (code
needing extras we do not install, such as sklearn, is never imported), and run as a private
module whose names (`alias`, `_clipping`, `optax`) are proxies answering with jaxfuse's
transforms where asked and optax's objects otherwise. Line numbers are kept for tracebacks.
"""

import ast
import dataclasses
import importlib.util
import pathlib
import re
import sys
import types
import unittest
from typing import Any, Callable, Iterable, Mapping, Optional

# Overrides for one module name: attribute -> replacement, or a nested dict for a submodule
# (e.g. {"tree": {"norm": jaxfuse.global_norm}} for `optax`).
Overrides = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Keep:
  """Keeps the elements of a module-level tuple/list literal whose `field` (a dict key, or an
  index into a tuple/list; a literal) is in `values`. Every value must match some element, so a
  rename in optax fails loudly instead of silently emptying the suite."""
  field: Any
  values: frozenset

  def key(self, node: ast.expr) -> Any:
    """The literal value of this element's field."""
    if isinstance(node, ast.Dict):
      fields = {ast.literal_eval(k): v for k, v in zip(node.keys, node.values) if k is not None}
      return ast.literal_eval(fields[self.field])
    if isinstance(node, (ast.Tuple, ast.List)):
      return ast.literal_eval(node.elts[self.field])
    raise TypeError(f"cannot filter an element of type {type(node).__name__}")


def keep(field: Any, values: Iterable[Any]) -> Keep:
  return Keep(field, frozenset(values))


class ProxyModule(types.ModuleType):
  """A stand-in for a module: the overridden attributes are set on the proxy itself, anything
  else falls back to the real module (so e.g. `alias.sgd` stays optax's)."""

  def __init__(self, real: types.ModuleType, overrides: Overrides):
    super().__init__(real.__name__, real.__doc__)
    self._real = real
    for attr, value in overrides.items():
      if not hasattr(real, attr):
        raise AttributeError(f"{real.__name__} has no {attr!r} to override")
      if isinstance(value, Mapping):
        value = ProxyModule(getattr(real, attr), value)
      setattr(self, attr, value)

  def __getattr__(self, attr: str) -> Any:
    if attr == "_real":  # not set yet (e.g. during copying): no recursion
      raise AttributeError(attr)
    return getattr(self._real, attr)

  def __dir__(self) -> list:
    return sorted(set(super().__dir__()) | set(dir(self._real)))


def optax_file(relpath: str) -> pathlib.Path:
  """The path of a file inside the installed optax package (found without importing tests)."""
  spec = importlib.util.find_spec("optax")
  if spec is None or not spec.submodule_search_locations:
    raise ImportError("optax is not installed")
  for root in spec.submodule_search_locations:
    path = pathlib.Path(root, relpath)
    if path.is_file():
      return path
  raise FileNotFoundError(f"optax/{relpath} is not in the installed optax package")


DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)
IMPORTS = (ast.Import, ast.ImportFrom)


def imported_name(alias: ast.alias) -> str:
  """The name one entry of an import statement binds (`import a.b` binds `a`)."""
  return alias.asname or alias.name.split(".")[0]


def bound_names(node: ast.stmt) -> set:
  """The module-level names a statement binds."""
  if isinstance(node, IMPORTS):
    return set(map(imported_name, node.names))
  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
    return {node.name}
  if not isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
    return set()
  targets = node.targets if isinstance(node, ast.Assign) else [node.target]
  return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def used_names(node: ast.AST) -> set:
  """The names a piece of code reads (for dependency pruning; over-approximating is safe)."""
  return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)
          and not isinstance(n.ctx, ast.Store)}


def is_main_guard(node: ast.stmt) -> bool:
  """`if __name__ == '__main__':`, which must not run when loaded as a module."""
  return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
          and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def trim_class(node: ast.ClassDef, methods: Optional[Iterable[str]]) -> None:
  """Drops the test* methods of a class that are not in `methods` (None keeps them all);
  helpers such as setUp stay."""
  if methods is None:
    return
  methods = set(methods)
  defined = {s.name for s in node.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
  if methods - defined:
    raise AttributeError(f"{node.name} has no {sorted(methods - defined)}")
  node.body = [s for s in node.body if not (
      isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))
      and s.name.startswith("test") and s.name not in methods)]


def filter_assignment(node: ast.stmt, rule: Keep) -> None:
  """Keeps the elements of an assigned tuple/list literal that `rule` selects."""
  value = getattr(node, "value", None)
  if not isinstance(value, (ast.Tuple, ast.List)):
    raise TypeError(f"line {node.lineno}: not a tuple/list literal")
  value.elts = [e for e in value.elts if rule.key(e) in rule.values]
  found = {rule.key(e) for e in value.elts}
  if found != rule.values:
    raise LookupError(f"line {node.lineno}: no element with {rule.field}="
                      f"{sorted(map(repr, rule.values - found))}")


def select_statements(body: list, classes: Mapping[str, Optional[Iterable[str]]],
                      filters: Mapping[str, Keep]) -> tuple[list, set]:
  """(statements, names they read): the module body cut down to the requested classes and what
  they need, transitively (what only unrequested test classes use is dropped; imports are
  decided later, once the kept code is known)."""
  body = [s for s in body if not is_main_guard(s)
          and not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
  found = {s.name for s in body if isinstance(s, ast.ClassDef)}
  if set(classes) - found:
    raise LookupError(f"no class {sorted(set(classes) - found)}")
  for stmt in body:
    if isinstance(stmt, ast.ClassDef) and stmt.name in classes:
      trim_class(stmt, classes[stmt.name])
    for name in bound_names(stmt) & set(filters):
      filter_assignment(stmt, filters[name])
  code = [s for s in body if not isinstance(s, IMPORTS)]
  # Roots: the requested classes, and statements that are not plain definitions (side effects).
  roots = [s for s in code if not isinstance(s, DEFINITIONS)
           or (isinstance(s, ast.ClassDef) and s.name in classes)]
  kept, needed = reachable(code, roots)
  return [s for s in body if isinstance(s, IMPORTS) or s in kept], needed


def reachable(code: list, roots: list) -> tuple[list, set]:
  """(statements, names they read): `roots` and every statement of `code` that binds a name
  they read, transitively."""
  kept, needed, new = [], set(), roots
  while new:
    kept += new
    needed = needed.union(*map(used_names, new))
    new = [s for s in code if s not in kept and bound_names(s) & needed]
  return kept, needed


def prune_imports(body: list, needed: set, swapped: Iterable[str]) -> list:
  """Drops the imported names that no kept code reads, and those replaced by proxies (the
  proxy is pre-seeded in the module's globals, and an import would overwrite it)."""
  out = []
  for stmt in body:
    if isinstance(stmt, IMPORTS) and getattr(stmt, "module", None) != "__future__":
      stmt.names = [a for a in stmt.names if a.name == "*" or (
          imported_name(a) in needed and imported_name(a) not in swapped)]
      if not stmt.names:
        continue
    out.append(stmt)
  return out


def real_module(body: list, name: str, package: str) -> types.ModuleType:
  """What the file's own import of `name` binds, found by running just that import (a copy of
  its statement that imports only `name`)."""
  for stmt in body:
    for alias in stmt.names if isinstance(stmt, IMPORTS) else ():
      if imported_name(alias) == name:
        one = type(stmt)(**{**{f: getattr(stmt, f) for f in stmt._fields}, "names": [alias]})
        scope = {"__name__": f"{package}.__scratch__", "__package__": package}
        exec(compile(ast.Module([ast.copy_location(one, stmt)], []), "<import>", "exec"), scope)
        return scope[name]
  raise LookupError(f"the file imports no module as {name!r} to override")


def load(relpath: str, classes: Mapping[str, Optional[Iterable[str]]], *,
         overrides: Optional[Mapping[str, Overrides]] = None,
         filters: Optional[Mapping[str, Keep]] = None) -> types.ModuleType:
  """Loads optax/<relpath> as a fresh private module.

  classes: test class name -> the test* method names (as written in the source) to keep, or
    None for all of them. Other classes, and code only they need, are dropped.
  overrides: module name as bound in the file (e.g. "alias") -> {attribute: replacement}.
  filters: module-level assignment name -> Keep rule for its tuple/list literal; applied before
    the module body runs, so values captured at import time (parameter lists) see it.
  """
  overrides, filters = overrides or {}, filters or {}
  path = optax_file(relpath)
  tree = ast.parse(path.read_text(), filename=str(path))
  package = "optax." + ".".join(pathlib.PurePosixPath(relpath).parent.parts)
  proxies = {name: ProxyModule(real_module(tree.body, name, package), attrs)
             for name, attrs in overrides.items()}
  body, needed = select_statements(tree.body, classes, filters)
  tree.body = prune_imports(body, needed, proxies)
  name = "_jaxfuse_optax_suite_" + re.sub(r"\W", "_", relpath.removesuffix(".py"))
  module = types.ModuleType(name, f"optax/{relpath}, as loaded by {__name__}")
  module.__dict__.update(proxies, __file__=str(path))
  sys.modules[name] = module  # before running it, as importlib does (dataclasses look it up)
  exec(compile(tree, str(path), "exec"), module.__dict__)
  return module


def generated_params(cls: type) -> dict:
  """{generated method name: its parameters as a dict} for absl parameterized tests, read from
  the class's `_test_params_reprs` (absl's repr of each method's keyword parameters, as in its
  test ids: "(opt_name='adam', dtype='float32')"). Classes and functions among them stand as
  their names ("complex64", "_setup_parabola"); other non-literal parameters' cases are left out."""
  out = {}
  for method, text in getattr(cls, "_test_params_reprs", {}).items():
    text = re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>|<function (\w+) at 0x[0-9a-f]+>",
                  lambda m: repr(m.group(1) or m.group(2)), text)
    try:
      call = ast.parse("f" + text, mode="eval").body
      out[method] = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    except (SyntaxError, ValueError, AttributeError):
      continue
  return out


def skip_cases(cls: type, cases: Iterable[tuple]) -> None:
  """Skips exact generated cases with unittest.skip: each case is (method name as written in
  the source, its full parameter dict, reason) and must match exactly one generated method."""
  params = generated_params(cls)
  source_name = lambda m: getattr(getattr(getattr(cls, m), "__wrapped__", None), "__name__", None)
  for method, wanted, reason in cases:
    hits = [m for m, p in params.items() if p == wanted and source_name(m) == method]
    if len(hits) != 1:
      raise LookupError(f"{cls.__name__}.{method}{wanted}: {len(hits)} generated cases match")
    setattr(cls, hits[0], unittest.skip(reason)(getattr(cls, hits[0])))


def keep_cases(cls: type, keep: Callable[[dict], bool]) -> None:
  """Removes the generated cases whose parameter dict `keep` rejects (for a list of cases built
  by code rather than written as a literal, which `filters` cannot cut down); raises if none is
  kept, so that a rename in optax fails loudly."""
  params = generated_params(cls)
  kept = [m for m, p in params.items() if keep(p)]
  if not kept:
    raise LookupError(f"{cls.__name__}: no generated case is kept")
  for method in set(params) - set(kept):
    delattr(cls, method)
