"""The import graph of the whole repository has no cycle: kvax_plugin, benchmarks (and its
tools), scripts, configs, the tests' and integration's helper modules, read from the source
(ast), so an import inside a function counts as much as one at the top.

Nodes are files. An import resolves to a file of the repository the way Python would find it
for these programs: a dotted name from the repository root (benchmarks.cases); a relative
import from the file's package; a bare name from the file's own directory first (a script's
directory is on sys.path, and pytest puts a test's directory there), then from the directories
the programs put on sys.path (SEARCH_DIRS). `from package import name` points at package.name
when that is a file. Implicit imports of parent packages are not edges (a package's __init__
that re-exports its submodules would otherwise be a cycle by construction); tests/
test_layering.py holds the finer rules of kvax_plugin's layers.
"""

from __future__ import annotations

import ast
import os
import textwrap

import pytest

from test_layering import find_cycle  # the same search over this wider graph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Directories the repository's programs put on sys.path for bare-name imports, after their own.
SEARCH_DIRS = ("", "tests", os.path.join("tests", "gpu"), "integration",
               os.path.join("integration", "levanter"), "benchmarks", "scripts")
SKIP_DIRS = {"outputs", "__pycache__", "node_modules", "patches"}


def python_files(root: str) -> list[str]:
  """Every .py file under root (relative paths), hidden and output folders left out."""
  out = []
  for dirpath, dirnames, files in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS)
    out += [os.path.relpath(os.path.join(dirpath, f), root) for f in sorted(files)
            if f.endswith(".py")]
  return out


def _module_file(root: str, base_dir: str, dotted: str, files: set[str]) -> str | None:
  """The file of `dotted` under base_dir (a module or a package's __init__), or None."""
  rel = os.path.join(base_dir, *dotted.split("."))
  for candidate in (rel + ".py", os.path.join(rel, "__init__.py")):
    candidate = os.path.normpath(candidate)
    if candidate in files:
      return candidate
  return None


def resolve(root: str, importer: str, dotted: str, files: set[str],
            search_dirs=SEARCH_DIRS) -> str | None:
  """The repository file `import dotted` in `importer` loads (longest known prefix), or None
  for a module from outside the repository."""
  parts = dotted.split(".")
  own_dir = os.path.dirname(importer)
  while parts:
    name = ".".join(parts)
    for base in (own_dir,) + tuple(search_dirs):
      found = _module_file(root, base, name, files)
      if found:
        return found
    parts.pop()
  return None


def import_graph(root: str, search_dirs=SEARCH_DIRS) -> dict[str, set[str]]:
  """File -> the repository files it imports anywhere in its source."""
  files = python_files(root)
  known = set(files)
  graph: dict[str, set[str]] = {}
  for path in files:
    with open(os.path.join(root, path), encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
    package_dir = os.path.dirname(path)
    targets: set[str | None] = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        for alias in node.names:
          targets.add(resolve(root, path, alias.name, known, search_dirs))
      elif isinstance(node, ast.ImportFrom):
        if node.level:  # relative: from the file's package, up level - 1 packages
          base_dir = package_dir
          for _ in range(node.level - 1):
            base_dir = os.path.dirname(base_dir)
          mod = node.module or ""
          base = (_module_file(root, base_dir, mod, known) if mod
                  else os.path.normpath(os.path.join(base_dir, "__init__.py")))
          for alias in node.names:
            sub = _module_file(root, base_dir, ".".join(filter(None, (mod, alias.name))), known)
            targets.add(sub or (base if base in known else None))
        else:
          mod = node.module or ""
          for alias in node.names:
            sub = resolve(root, path, f"{mod}.{alias.name}", known, search_dirs)
            whole = resolve(root, path, mod, known, search_dirs)
            # `from pkg import mod` names pkg/mod.py; `from mod import func` names mod.py
            targets.add(sub if sub and sub != whole else whole)
    graph[path] = {t for t in targets if t and t != path}
  return graph


@pytest.fixture(scope="module")
def graph():
  return import_graph(ROOT)


def _p(*parts):
  return os.path.join(*parts)


def test_graph_sees_the_tree(graph):
  # Guards the scanner: the trees it must cover, and known edges of each import form.
  for tree in ("kvax_plugin", "benchmarks", "scripts", "tests", "integration"):
    assert any(f.startswith(tree + os.sep) for f in graph), tree
  run, bench = _p("benchmarks", "run.py"), _p("benchmarks", "bench_attention.py")
  assert bench in graph[run]  # from benchmarks import bench_attention
  assert _p("benchmarks", "cases.py") in graph[bench]  # from benchmarks.cases import ...
  assert _p("benchmarks", "tools", "kernel_parts.py") in graph[bench]
  # a bare sibling import of a script (benchmarks/ on sys.path)
  assert _p("benchmarks", "cp_layouts.py") in graph[_p("benchmarks", "cp_balance.py")]
  # a tests/ helper imported by name
  assert _p("tests", "layouts.py") in graph[_p("benchmarks", "cuda_backward_check.py")]
  # a function-level import inside kvax_plugin
  assert (_p("kvax_plugin", "attention", "kernels", "triton", "forward.py")
          in graph[_p("kvax_plugin", "attention", "kernels", "triton", "backend.py")])
  assert len(graph) > 150


def test_no_import_cycle_in_the_repository(graph):
  cycle = find_cycle(graph)
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_benchmark_modules_import_at_the_top(graph):
  """The benchmark command's modules hold no function-level import of a repository module
  (the old bench_attention <-> run <-> tools/kernel_parts cycle hid behind such imports)."""
  names = ("cases", "timing", "impls", "fa3", "results", "bench_attention", "run", "gate",
           "gate_worker")
  bad = []
  for name in names:
    path = _p("benchmarks", f"{name}.py")
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
      if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
        if any(resolve(ROOT, path, m or "", set(graph)) for m in mods):
          bad.append(f"{path}:{node.lineno}")
  assert not bad, "function-level imports of repository modules: " + ", ".join(bad)


def test_detects_a_cycle_through_a_function_and_a_script_sibling(tmp_path):
  # The check must fail on a cycle: a package edge, a local (function-level) relative import,
  # and a script's bare import of its sibling close it.
  pkg = tmp_path / "pkg"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from pkg import b\n")
  (pkg / "b.py").write_text(textwrap.dedent("""
      def f():
        from .c import g
        return g
  """))
  (pkg / "c.py").write_text("import d\n")  # pkg/d.py: the script directory's sibling
  (pkg / "d.py").write_text("from pkg.a import x\n")
  g = import_graph(str(tmp_path), search_dirs=("",))
  assert find_cycle(g) == [_p("pkg", "a.py"), _p("pkg", "b.py"), _p("pkg", "c.py"),
                           _p("pkg", "d.py"), _p("pkg", "a.py")]
  (pkg / "d.py").write_text("import os\nimport numpy\n")
  assert find_cycle(import_graph(str(tmp_path), search_dirs=("",))) is None
