"""The source tree's floor plan (docs/layout.md), checked on every import and include.

Two products over a small core: the optimizers (``jaxfuse/_optim``, ``csrc/optim``) and the
decoder (``jaxfuse/_decode``, ``csrc/decoder``) never reach into each other; the core
(``jaxfuse/_core``, ``csrc/core``) reaches into neither; ``jaxfuse._report`` reports on both and
nothing below it imports it; nothing in the package reaches into ``tools/``; and no import or
include closes a cycle. Every import statement counts, those inside functions too (not those
under ``if TYPE_CHECKING:``, which run only for a type checker).
"""

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What each wing may reach, by its first name below the package (or csrc/).
PYTHON_WINGS = {"_core": {"_core"}, "_optim": {"_core", "_optim"},
                "_decode": {"_core", "_decode"},
                "_report": {"_core", "_optim", "_decode", "_report"}}
CPP_WINGS = {"core": {"core"}, "optim": {"core", "optim"}, "decoder": {"core", "decoder"}}
# Quoted includes of libraries the build puts on the include path (XLA's FFI headers from jaxlib).
EXTERNAL_HEADERS = ("xla/",)


def python_modules():
  """{module name: path} of every module of the package."""
  paths = [os.path.join(folder, f) for folder, _, files in os.walk(os.path.join(ROOT, "jaxfuse"))
           for f in files if f.endswith(".py")]
  return {os.path.relpath(p, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__"): p
          for p in paths}


def _runtime_nodes(tree):
  """Every node of `tree` but those under ``if TYPE_CHECKING:`` (imports for annotations only)."""
  stack = [tree]
  while stack:
    node = stack.pop()
    yield node
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
        stack.extend(child.orelse)
      else:
        stack.append(child)


def python_imports(module, path, known):
  """The package's modules (and any top-level packages) that `module`'s import statements name."""
  out = set()
  package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
  for node in _runtime_nodes(ast.parse(open(path).read(), path)):
    if isinstance(node, ast.Import):
      out.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] +
                        ([base] if base else []))
      out.add(base)
      out.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known)
  return {name for name in out if name}


def cpp_sources():
  """{path relative to csrc/: absolute path} of every C++ and CUDA source."""
  base = os.path.join(ROOT, "csrc")
  return {os.path.relpath(os.path.join(d, f), base): os.path.join(d, f)
          for d, _, files in os.walk(base) for f in files}


def find_cycle(graph):
  """One cycle of `graph` ({node: successors}) as a list of nodes, or None."""
  state = {}

  def visit(node, stack):
    state[node] = "open"
    stack.append(node)
    for succ in sorted(graph.get(node, ())):
      if state.get(succ) == "open":
        return stack[stack.index(succ):] + [succ]
      if succ not in state and (cycle := visit(succ, stack)):
        return cycle
    stack.pop()
    state[node] = "done"
    return None

  for node in sorted(graph):
    if node not in state and (cycle := visit(node, [])):
      return cycle
  return None


def python_graph():
  known = python_modules()
  return {module: {name for name in python_imports(module, path, known)
                   if name in known or name.split(".")[0] == "tools"}
          for module, path in known.items()}


def wing_violations(graph, wing_of, rules):
  """'a -> b' for every edge from a wing to what its rule does not allow."""
  return sorted(f"{node} -> {succ}" for node, succs in graph.items() for succ in succs
                if wing_of(node) in rules and wing_of(succ) not in rules[wing_of(node)])


def python_wing(module):
  parts = module.split(".")
  if parts[0] == "tools":
    return "tools"
  return parts[1] if len(parts) > 1 and parts[1] in PYTHON_WINGS else "public"


def cpp_graph():
  includes = lambda path: re.findall(r'^\s*#\s*include\s+"([^"]+)"', open(path).read(), re.M)
  return {rel: {inc for inc in includes(path) if not inc.startswith(EXTERNAL_HEADERS)}
          for rel, path in cpp_sources().items()}


def test_python_imports_stay_in_their_wings_and_close_no_cycle():
  graph = python_graph()
  assert {"jaxfuse._core.ffi", "jaxfuse._optim.kernel_path",
          "jaxfuse._decode.kernel"} <= set(graph), "the walk found the package"
  assert "jaxfuse._core.ffi" in graph["jaxfuse._optim.kernel_path"], "the walk sees imports"
  bad = wing_violations(graph, python_wing, PYTHON_WINGS)
  bad += [f"{m} -> {s}" for m, succs in graph.items() for s in succs if s.startswith("tools")]
  assert not bad, "imports across wings, or from the package into tools/:\n" + "\n".join(bad)
  cycle = find_cycle(graph)
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cpp_includes_stay_in_their_wings_and_close_no_cycle():
  graph = cpp_graph()
  sources = cpp_sources()
  unresolved = sorted(f"{f} includes \"{inc}\"" for f, incs in graph.items() for inc in incs
                      if inc not in sources)
  assert not unresolved, ("includes that name no file under csrc/ (each names its wing from "
                          "csrc/, and nothing outside it):\n" + "\n".join(unresolved))
  bad = wing_violations(graph, lambda rel: rel.split(os.sep)[0], CPP_WINGS)
  assert not bad, "includes across wings:\n" + "\n".join(bad)
  assert "core/op.h" in graph["optim/optimizer.h"], "the walk sees includes"
  cycle = find_cycle(graph)
  assert cycle is None, "include cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("graph, rules, expected", [
    ({"jaxfuse._optim.a": {"jaxfuse._decode.b"}, "jaxfuse._decode.b": set()}, PYTHON_WINGS,
     ["jaxfuse._optim.a -> jaxfuse._decode.b"]),
    ({"jaxfuse._core.a": {"jaxfuse._report.b"}}, PYTHON_WINGS,
     ["jaxfuse._core.a -> jaxfuse._report.b"]),
    ({"jaxfuse._report.a": {"jaxfuse._optim.b", "jaxfuse._decode.c"}}, PYTHON_WINGS, []),
])
def test_the_check_sees_a_crossing(graph, rules, expected):
  assert wing_violations(graph, python_wing, rules) == expected
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_does_not_know_the_emulator():
  """The CUDA-on-CPU emulator is a test tool: the tests register its module (tests/helpers.py);
  nothing the package installs names it."""
  named = sorted(os.path.relpath(path, ROOT) for path in python_modules().values()
                 if re.search(r"cuda_on_cpu|emulat", open(path).read(), re.I))
  assert not named, f"package modules that name the emulator: {named}"
