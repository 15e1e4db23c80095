"""The README's and docs/' code runs as written, and their relative links resolve.

Every ```python block of a page runs, in order, in one namespace, in a fresh interpreter per page
(so the blocks' own imports are what is tested); a failing block is reported at its file and
line. A block that cannot run as written (it needs a checkpoint, 8 devices, another page's
variables) is fenced ```python no-run; any other Python fence fails, so that no block goes
untested by accident. The blocks use tiny shapes and few steps (10-15 s a page on 2 CPU cores).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import optax
import pytest

import jaxfuse
from jaxfuse._optim import families

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

RUN, NO_RUN = "python", "python no-run"
PYTHON_LANGS = {"python", "python3", "py", "pycon", "pyi", "ipython", "ipython3"}
TIMEOUT_S = 300


@dataclasses.dataclass
class Block:
  line: int  # 1-based line of the opening fence
  info: str  # the fence's info string, stripped
  code: str


def fenced_blocks(text: str) -> list[Block]:
  """The fenced code blocks of a Markdown text (CommonMark fences: ``` or ~~~, at most three
  spaces of indentation, closed by a fence of the same character at least as long)."""
  blocks, lines, i = [], text.splitlines(), 0
  while i < len(lines):
    m = re.match(r"^( {0,3})(`{3,}|~{3,})(.*)$", lines[i])
    if not m or (m[2][0] == "`" and "`" in m[3]):
      i += 1
      continue
    indent, fence, info, start = len(m[1]), m[2], m[3].strip(), i
    close = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
    body = []
    i += 1
    while i < len(lines) and not close.match(lines[i]):
      line = lines[i]
      body.append(line[min(indent, len(line) - len(line.lstrip(" "))):])  # up to the fence's
      i += 1
    blocks.append(Block(start + 1, info, "\n".join(body) + "\n"))
    i += 1  # past the closing fence (or the end: an unclosed fence runs to the end)
  return blocks


def python_blocks(page: Path) -> tuple[list[Block], list[Block], list[Block]]:
  """(blocks to run, blocks marked no-run, Python blocks marked neither) of a page."""
  run, skipped, unmarked = [], [], []
  for block in fenced_blocks(page.read_text()):
    words = block.info.split()
    if words and words[0].lower() in PYTHON_LANGS:
      (run if block.info == RUN else skipped if words == NO_RUN.split() else unmarked).append(block)
  return run, skipped, unmarked


# Runs the blocks listed in a JSON file [[path, fence line, code], ...] in one namespace. Each
# block is compiled padded with newlines to its first code line, under the page's path, so that
# tracebacks name the page's own lines (and linecache shows them).
_RUNNER = textwrap.dedent("""
    import json, sys, traceback
    blocks = json.load(open(sys.argv[1]))
    namespace = {"__name__": "__main__"}
    for path, line, code in blocks:
      print(f"=== running the block at {path}:{line}", flush=True)
      try:
        exec(compile("\\n" * line + code, path, "exec"), namespace)
      except BaseException:
        traceback.print_exc()
        print(f"=== FAILED: the block at {path}:{line}", flush=True)
        sys.exit(1)
    print("=== all blocks ran", flush=True)
    """)


def _subprocess_env() -> dict[str, str]:
  """This environment, with the jaxfuse this test session imported first on the path."""
  env = dict(os.environ)
  package_root = str(Path(jaxfuse.__file__).resolve().parent.parent)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
  return env


def run_python(code: str, *args: str, cwd: Path) -> tuple[int, str]:
  """Runs `code` in a fresh interpreter, in `cwd`: (exit status, -1 on a timeout; output)."""
  try:
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=_subprocess_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired as e:
    out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    return -1, f"{out}\n=== timed out after {TIMEOUT_S} s"
  return proc.returncode, proc.stdout


def run_blocks(page: Path, blocks: list[Block], tmp_path: Path) -> tuple[int, str]:
  (tmp_path / "blocks.json").write_text(json.dumps([[str(page), b.line, b.code] for b in blocks]))
  return run_python(_RUNNER, str(tmp_path / "blocks.json"), cwd=tmp_path)


def _rel(page: Path) -> str:
  """The page's path relative to the repository (as given when outside it)."""
  page = Path(page)
  return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def _failure(page: Path, rc: int, out: str) -> str:
  """The assertion message: which block failed (file and line), then the output's end."""
  failed = re.findall(r"=== FAILED: the block at (.*):(\d+)", out)
  where = (f"the ```python block at {_rel(failed[-1][0])}:{failed[-1][1]} failed"
           if failed else f"{_rel(page)}'s blocks exited with status {rc}")
  return f"{where}\n{out[-6000:]}"


RUNNABLE_PAGES = [p for p in PAGES if python_blocks(p)[0]]


def test_every_python_block_is_run_or_marked_no_run():
  unmarked = [f"{_rel(p)}:{b.line}: ```{b.info}" for p in PAGES for b in python_blocks(p)[2]]
  assert not unmarked, (f"Python blocks neither ```{RUN} (run by this test) nor ```{NO_RUN}: "
                        f"{unmarked}")
  # The README's use and the guide's Quick start are what this file exists for: they must keep
  # running blocks.
  assert len(python_blocks(ROOT / "README.md")[0]) >= 1
  assert len(python_blocks(ROOT / "docs" / "guide.md")[0]) >= 2


def test_readme_first_screen():
  """The README from its title to the two commands (what it is, install, use) fits one screen."""
  text = (ROOT / "README.md").read_text()
  first = text[:text.index("## The two commands")]
  lines = len(first.splitlines())
  assert lines <= 45, f"the README's first screen is {lines} lines (at most 45)"
  assert "## Install" in first and "python -m jaxfuse" in first


@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=_rel)
def test_python_blocks_run_as_written(page, tmp_path):
  rc, out = run_blocks(page, python_blocks(page)[0], tmp_path)
  assert rc == 0 and out.rstrip().endswith("=== all blocks ran"), _failure(page, rc, out)


def test_a_failing_block_fails_with_its_line(tmp_path):
  """The runner itself: blocks share one namespace, and a failing block is reported at its line
  in the page (and the traceback at the failing line)."""
  page = tmp_path / "page.md"
  page.write_text("# page\n\n```python\nx = 41\n```\n\ntext\n\n```python\ny = x + 1\n"
                  "assert y == 41, 'planted'\n```\n\n```python no-run\nnever run\n```\n")
  run, skipped, unmarked = python_blocks(page)
  assert [b.line for b in run] == [3, 9] and [b.line for b in skipped] == [14] and not unmarked
  rc, out = run_blocks(page, run, tmp_path)
  assert rc == 1, out
  assert f"=== FAILED: the block at {page}:9" in out, out
  assert f'File "{page}", line 11' in out and "planted" in out, out
  assert _failure(page, rc, out).startswith(f"the ```python block at {page}:9 failed")


def test_fence_parsing():
  text = ("````markdown\n```python\nnot a block of its own\n```\n````\n"
          "  ```py\n  a = 1\n  ```\n"
          "inline ```python``` is no fence\n"
          "~~~python no-run\nb = 2\n~~~\n")
  blocks = fenced_blocks(text)
  assert [(b.line, b.info, b.code) for b in blocks] == [
      (1, "markdown", "```python\nnot a block of its own\n```\n"),
      (6, "py", "a = 1\n"),
      (10, "python no-run", "b = 2\n"),
  ]


# ---- links ---------------------------------------------------------------------------------------

def _outside_fences(text: str) -> list[str]:
  """The text's lines, those of fenced blocks (fences included) blanked."""
  lines = text.splitlines()
  for block in fenced_blocks(text):
    end = block.line + block.code.count("\n")  # the closing fence's 0-based index
    lines[block.line - 1:end + 1] = [""] * (end + 2 - block.line)
  return lines


def _prose(text: str) -> str:
  """The text without its fenced blocks and inline code spans (links are not parsed there)."""
  return re.sub(r"(`+)(?!`).*?(?<!`)\1(?!`)", "", "\n".join(_outside_fences(text)))


def heading_anchors(text: str) -> set[str]:
  """GitHub's anchors of a page's headings: lowercased, punctuation dropped, spaces to hyphens,
  repeats numbered -1, -2, ..."""
  anchors, seen = set(), {}
  for line in _outside_fences(text):  # headings keep their inline code: it is in the anchor
    m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
    if not m:
      continue
    slug = re.sub(r"[^\w\- ]", "", m[1].lower()).replace(" ", "-")
    n = seen.get(slug, 0)
    seen[slug] = n + 1
    anchors.add(slug if n == 0 else f"{slug}-{n}")
  return anchors


def relative_links(page: Path) -> list[str]:
  """The targets of the page's links and images that are not URLs."""
  return [target for target in re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?[^)]*\)",
                                          _prose(page.read_text()))
          if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto:


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page):
  broken = []
  for target in relative_links(page):
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
      broken.append(f"{target} (no file {dest})")
    elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text()):
      broken.append(f"{target} (no heading #{anchor} in {_rel(dest)})")
  assert not broken, f"{_rel(page)}: broken links: {broken}"


def test_links_are_found():
  """The link check sees the README's links to docs/ (a regex that found nothing would pass)."""
  links = relative_links(ROOT / "README.md")
  assert "docs/optimizers.md" in links and "docs/guide.md" in links
  assert "decoder.md#trying-it-without-a-checkpoint" in relative_links(ROOT / "docs" / "guide.md")
  assert "optimizers.md#which-path" in relative_links(ROOT / "docs" / "api.md")
  assert "which-path" in heading_anchors(ROOT.joinpath("docs", "optimizers.md").read_text())
  assert "what-fusion-saves-jaxfusereport" in heading_anchors(
      ROOT.joinpath("docs", "report.md").read_text())


# ---- jaxfuse.flax without `import jaxfuse.flax` --------------------------------------------------

_LAZY_FLAX = textwrap.dedent("""
    import importlib.util, re, sys
    import pytest
    sys.modules["flax"] = None          # flax missing: import jaxfuse must not need it
    import jaxfuse
    assert "jaxfuse.flax" not in sys.modules
    assert not hasattr(jaxfuse, "flax")
    with pytest.raises(AttributeError, match=re.escape("pip install 'jaxfuse[flax]'")) as e:
      jaxfuse.flax
    assert isinstance(e.value.__cause__, ModuleNotFoundError), repr(e.value.__cause__)
    with pytest.raises(AttributeError, match="no_such_name"):
      jaxfuse.no_such_name
    del sys.modules["flax"]             # flax installed: jaxfuse.flax loads on first use
    if importlib.util.find_spec("flax") is None:
      print("flax not installed")
    else:
      assert jaxfuse.flax.TrainState.__module__ == "jaxfuse.flax"
      assert jaxfuse.flax.Optimizer is sys.modules["jaxfuse.flax"].Optimizer
      print("jaxfuse.flax loaded")
    """)


def test_jaxfuse_flax_loads_without_its_own_import(tmp_path):
  rc, out = run_python(_LAZY_FLAX, cwd=tmp_path)
  assert rc == 0, out
  if "flax not installed" in out:
    pytest.skip("flax is not installed (the missing-flax half ran)")
  assert "jaxfuse.flax loaded" in out


def _signature_text(name: str) -> str:
  """``name(args)`` as docs/api.md writes a public function: every parameter, defaults as repr,
  ``*`` before the keyword-only ones."""
  parts, keyword_only = [], False
  for p in inspect.signature(getattr(jaxfuse, name)).parameters.values():
    if p.kind == p.VAR_POSITIONAL:
      keyword_only = True
    if p.kind == p.KEYWORD_ONLY and not keyword_only:
      parts.append("*")
      keyword_only = True
    star = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
    parts.append(star + (p.name if p.default is p.empty else f"{p.name}={p.default!r}"))
  return f"{name}({', '.join(parts)})"


def test_api_page_signatures_are_the_functions():
  """docs/api.md's table rows that spell out a function's arguments spell them as they are."""
  rows = re.findall(r"^\| `(\w+)\(([^`]*)\)` \|", (ROOT / "docs" / "api.md").read_text(), re.M)
  spelled = [(name, args) for name, args in rows if args != "..." and hasattr(jaxfuse, name)
             and callable(getattr(jaxfuse, name))]
  assert len(spelled) >= 8, rows
  wrong = [f"docs: {name}({args})\nreal: {_signature_text(name)}" for name, args in spelled
           if f"{name}({args})" != _signature_text(name)]
  assert not wrong, "\n\n".join(wrong)


def test_every_family_is_exported_and_documented():
  """Every optimizer family's functions (the family list) are in jaxfuse.__all__, have a row on
  docs/api.md, and each family's optax twin is named in the guide's table."""
  api = (ROOT / "docs" / "api.md").read_text()
  rows = set(re.findall(r"^\| `(\w+)\(", api, re.M)) | set(re.findall(r"`(\w+)\(\.\.\.\)`", api))
  guide = (ROOT / "docs" / "guide.md").read_text()
  missing = []
  for family in families.registered():
    for fn in family.functions:
      name = fn.__name__
      if name not in jaxfuse.__all__ or getattr(jaxfuse, name) is not fn:
        missing.append(f"jaxfuse.{name} is not exported")
      if name not in rows:
        missing.append(f"docs/api.md has no row for {name}")
    name = family.functions[0].__name__
    twin = f"optax.{name}" if hasattr(optax, name) else f"optax.contrib.{name}"
    if f"`{twin}`" not in guide:
      missing.append(f"docs/guide.md's table does not name {twin}")
  for fn in families.composites():
    if fn.__name__ not in jaxfuse.__all__ or fn.__name__ not in rows:
      missing.append(f"jaxfuse.{fn.__name__} is not exported, or has no row on docs/api.md")
    if f"`optax.contrib.{fn.__name__}`" not in guide:
      missing.append(f"docs/guide.md's table does not name optax.contrib.{fn.__name__}")
  assert not missing, "\n".join(missing)
