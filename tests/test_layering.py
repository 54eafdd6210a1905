"""The import graph of kvax_plugin: no cycle (function-local imports included), and the attention
package in layers, kernel backends as leaves (kvax_plugin/attention/__init__.py lists them).

The graph is read from the source (ast), not by importing, so an import hidden inside a function
counts as much as one at the top. An edge goes from a module to every kvax_plugin module it
names; `from package import name` points at package.name when that is a module. Implicit imports
of parent packages (importing a.b.c runs a/__init__ and a/b/__init__) are not edges: a package's
__init__ that re-exports its submodules would otherwise be a cycle by construction.
"""

from __future__ import annotations

import ast
import os
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "kvax_plugin"
ATTENTION = f"{PACKAGE}.attention"
KERNELS = f"{ATTENTION}.kernels"

# Layers of the attention package, lowest first: a module may import only modules of lower
# layers (its own kernel leaf package aside). kvax_plugin.attention.__init__ is documentation.
ATTENTION_LAYERS: list[tuple[str, ...]] = [
    (f"{ATTENTION}.arguments",),
    (f"{ATTENTION}.params", f"{ATTENTION}.options", f"{ATTENTION}.specs"),
    (f"{ATTENTION}.block_mask",),
    (f"{ATTENTION}.sharded_mask",),
    (f"{ATTENTION}.validation",),
    (f"{ATTENTION}.reference", f"{ATTENTION}.token_order", f"{KERNELS}.capabilities",
     f"{KERNELS}.custom_vjp"),
    (f"{ATTENTION}.balance",),
    ("<kernel leaves>",),
    (f"{KERNELS}.hopper",),  # composes two leaves (the Mosaic forward, the CUDA C++ backward)
    (KERNELS,),
    (f"{ATTENTION}.split_kv_attention", f"{ATTENTION}.kv_exchange"),
    (f"{ATTENTION}.plan",),
    (f"{ATTENTION}.sharded",),
    (f"{ATTENTION}.run",),
    (f"{ATTENTION}.api", f"{ATTENTION}.context_parallel"),
    (f"{ATTENTION}.compare",),
]
# Modules of the kernels package that are not leaves: what every backend shares.
KERNELS_SHARED = {f"{KERNELS}.capabilities", f"{KERNELS}.custom_vjp"}
# Backends of the kernels package that compose leaves (not leaves themselves).
KERNELS_COMPOSED = {f"{KERNELS}.hopper"}
# What a kernel leaf may import besides its own files.
KERNEL_LEAF_MAY_IMPORT = {f"{ATTENTION}.params", f"{ATTENTION}.options",
                          f"{ATTENTION}.block_mask", f"{ATTENTION}.reference",
                          f"{KERNELS}.capabilities", f"{KERNELS}.custom_vjp"}


def module_files(root: str, package: str) -> dict[str, str]:
  """Dotted module name -> file path for every .py file of `package` under `root`."""
  out = {}
  base = os.path.join(root, *package.split("."))
  for dirpath, _, files in os.walk(base):
    for f in files:
      if not f.endswith(".py"):
        continue
      rel = os.path.relpath(os.path.join(dirpath, f), root)[:-3].split(os.sep)
      if rel[-1] == "__init__":
        rel = rel[:-1]
      out[".".join(rel)] = os.path.join(dirpath, f)
  return out


def import_graph(root: str, package: str) -> dict[str, set[str]]:
  """Module -> the package's modules it imports anywhere in its source (ast walk)."""
  modules = module_files(root, package)
  graph: dict[str, set[str]] = {}
  for name, path in modules.items():
    is_package = path.endswith("__init__.py")
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
    targets: set[str] = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        for alias in node.names:
          targets.add(_known(alias.name, modules))
      elif isinstance(node, ast.ImportFrom):
        if node.level:
          parts = name.split(".") if is_package else name.split(".")[:-1]
          parts = parts[:len(parts) - (node.level - 1)]
          base = ".".join(parts + ([node.module] if node.module else []))
        else:
          base = node.module or ""
        for alias in node.names:
          sub = f"{base}.{alias.name}"
          targets.add(sub if sub in modules else _known(base, modules))
    graph[name] = {t for t in targets if t and t != name}
  return graph


def _known(dotted: str, modules: dict[str, str]) -> str:
  """The longest prefix of `dotted` that is a module of the package ('' if none)."""
  parts = dotted.split(".")
  while parts:
    candidate = ".".join(parts)
    if candidate in modules:
      return candidate
    parts.pop()
  return ""


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One cycle as [a, b, ..., a], or None (iterative depth-first search)."""
  white, grey, black = 0, 1, 2
  color = {n: white for n in graph}
  for start in sorted(graph):
    if color[start] != white:
      continue
    stack = [(start, iter(sorted(graph[start])))]
    path = [start]
    color[start] = grey
    while stack:
      node, it = stack[-1]
      nxt = next(it, None)
      if nxt is None:
        color[node] = black
        stack.pop()
        path.pop()
        continue
      if nxt not in color:
        continue
      if color[nxt] == grey:
        return path[path.index(nxt):] + [nxt]
      if color[nxt] == white:
        color[nxt] = grey
        stack.append((nxt, iter(sorted(graph[nxt]))))
        path.append(nxt)
  return None


def kernel_leaf(module: str) -> str | None:
  """The kernel leaf (module or leaf package) a module belongs to, or None."""
  if (not module.startswith(KERNELS + ".") or module in KERNELS_SHARED
      or module in KERNELS_COMPOSED):
    return None
  return ".".join(module.split(".")[:4])  # kvax_plugin.attention.kernels.<leaf>


def layer_of(module: str) -> int | None:
  if kernel_leaf(module):
    return ATTENTION_LAYERS.index(("<kernel leaves>",))
  for i, layer in enumerate(ATTENTION_LAYERS):
    if module in layer:
      return i
  return None


@pytest.fixture(scope="module")
def graph():
  return import_graph(ROOT, PACKAGE)


def test_graph_sees_the_package(graph):
  # Guards the scanner itself: known edges, top-level and function-local, must be found.
  assert f"{ATTENTION}.api" in graph[PACKAGE]
  assert f"{ATTENTION}.block_mask" in graph[f"{ATTENTION}.api"]
  assert f"{KERNELS}.triton.forward" in graph[f"{KERNELS}.triton.backend"]  # a local import
  assert f"{KERNELS}.triton" in graph  # a leaf package
  assert len(graph) > 30


def test_no_import_cycle(graph):
  cycle = find_cycle(graph)
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_kernel_leaves_import_nothing_above_them(graph):
  leaves = {kernel_leaf(m) for m in graph if kernel_leaf(m)}
  assert {f"{KERNELS}.{n}" for n in ("jax_blockwise", "reference", "triton")} <= leaves
  bad = []
  for module, targets in graph.items():
    leaf = kernel_leaf(module)
    if leaf is None:
      continue
    for t in targets:
      if t not in KERNEL_LEAF_MAY_IMPORT and kernel_leaf(t) != leaf:
        bad.append(f"{module} imports {t}")
  assert not bad, "kernel leaves may import only params, block_mask, reference, " \
      "capabilities and their own files:\n" + "\n".join(bad)


def test_attention_layers(graph):
  bad = []
  for module, targets in graph.items():
    if not module.startswith(ATTENTION + ".") or module == ATTENTION:
      continue
    mine = layer_of(module)
    assert mine is not None, f"{module} has no layer: add it to ATTENTION_LAYERS"
    for t in targets:
      if kernel_leaf(t) and kernel_leaf(t) == kernel_leaf(module):
        continue
      theirs = layer_of(t)
      if theirs is None or theirs >= mine:
        bad.append(f"{module} (layer {mine}) imports {t} (layer {theirs})")
  assert not bad, "\n".join(bad)


def test_nothing_in_attention_imports_the_layers_above_it(graph):
  # The op never reaches up into stacks, integrations, data or the launcher.
  for module, targets in graph.items():
    if module.startswith(ATTENTION):
      assert all(t.startswith(ATTENTION) for t in targets), (module, targets)


def test_detects_a_cycle_hidden_in_a_function(tmp_path):
  # The check must fail on a cycle: a tiny package whose cycle closes through a local import.
  pkg = tmp_path / "cyc"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "a.py").write_text("from cyc import b\n")
  (pkg / "b.py").write_text(textwrap.dedent("""
      def f():
        from .c import g
        return g
  """))
  (pkg / "c.py").write_text("import cyc.a\n")
  g = import_graph(str(tmp_path), "cyc")
  assert find_cycle(g) == ["cyc.a", "cyc.b", "cyc.c", "cyc.a"]
  (pkg / "c.py").write_text("import os\n")
  assert find_cycle(import_graph(str(tmp_path), "cyc")) is None
