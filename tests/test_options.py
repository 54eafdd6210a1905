"""kvax_plugin.attention.options: KernelOptions' checks, and the environment variables kvax reads.

The module docstring's table lists every KVAX_* environment variable read anywhere in
kvax_plugin/; the test below reads the source (ast, not by importing) and compares, so a new
switch cannot creep in undocumented. Tuning belongs in KernelOptions.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvax_plugin.attention import options
from kvax_plugin.attention.options import KernelOptions

PACKAGE = Path(__file__).resolve().parents[1] / "kvax_plugin"
NAME = re.compile(r"\bKVAX_[A-Z0-9_]+\b")
# KVAX_* names in the source that are not environment variables and not Python names the
# package defines: the attribute the MaxText patch sets on its attention module, and a macro of
# the CUDA source (cuda_sm90/fused_backward.cu) its Python side names.
NOT_VARIABLES = {"KVAX_PATCHED", "KVAX_SM90_VARIANTS"}


def documented_variables() -> set[str]:
  """The names that start the rows of the table in options.py's docstring."""
  doc = options.__doc__
  table = doc[doc.index("This table is all of them"):doc.index("Names that look alike")]
  return {m.group(1) for m in re.finditer(r"^    (KVAX_[A-Z0-9_]+)\s", table, re.M)}


def _is_environ(node: ast.AST) -> bool:
  """os.environ or a bare environ."""
  return ((isinstance(node, ast.Attribute) and node.attr == "environ")
          or (isinstance(node, ast.Name) and node.id == "environ"))


def _environment_keys(tree: ast.Module):
  """The key expressions of every environment access in a module: os.environ[...] and
  os.environ.get / pop / setdefault (...), os.getenv(...), ... in os.environ."""
  for node in ast.walk(tree):
    if isinstance(node, ast.Subscript) and _is_environ(node.value):
      yield node.slice
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
      if _is_environ(node.func.value) and node.func.attr in ("get", "pop", "setdefault"):
        yield node.args[0]
      elif node.func.attr == "getenv":
        yield node.args[0]
    elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
      yield node.left


def environment_reads() -> tuple[set[str], list[str]]:
  """(KVAX_* variables read in kvax_plugin/, keys that are neither a string nor a module-level
  string constant, as "file:line")."""
  found, unresolved = set(), []
  for path in sorted(PACKAGE.rglob("*.py")):
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    constants = {target.id: node.value.value
                 for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for target in node.targets if isinstance(target, ast.Name)}
    for key in _environment_keys(tree):
      if isinstance(key, ast.Constant) and isinstance(key.value, str):
        value = key.value
      elif isinstance(key, ast.Name) and key.id in constants:
        value = constants[key.id]
      else:
        unresolved.append(f"{path.relative_to(PACKAGE.parent)}:{key.lineno}")
        continue
      if value.startswith("KVAX_"):
        found.add(value)
  return found, unresolved


def test_environment_variables_read_equal_the_documented_table():
  found, unresolved = environment_reads()
  assert not unresolved, (f"environment reads with a computed name {unresolved}: read a literal "
                          "or a module-level constant, so this test can see it")
  documented = documented_variables()
  assert documented, "the table in kvax_plugin/attention/options.py's docstring was not found"
  assert found == documented, (
      f"read but not documented: {sorted(found - documented)}; documented but not read: "
      f"{sorted(documented - found)}. A tuning switch belongs in KernelOptions; plumbing goes in "
      "options.py's table.")


def test_no_other_kvax_names_in_the_package():
  """Every KVAX_* token in kvax_plugin/*.py (code, comments, docstrings) is a documented
  variable, a Python name the package defines or imports, or one of NOT_VARIABLES: no stale
  mention of a removed switch, and no environment name built at run time."""
  defined = set(NOT_VARIABLES) | documented_variables()
  sources = {path: path.read_text(encoding="utf-8") for path in PACKAGE.rglob("*.py")}
  for path, text in sources.items():
    for node in ast.walk(ast.parse(text, str(path))):
      if isinstance(node, ast.Name):
        defined.add(node.id)
      elif isinstance(node, ast.alias):
        defined.add(node.asname or node.name.split(".")[-1])
  stray = sorted({f"{path.relative_to(PACKAGE.parent)}: {m.group(0)}"
                  for path, text in sources.items() for m in NAME.finditer(text)
                  if m.group(0) not in defined})
  assert not stray, stray


def test_kernel_options_defaults_and_checks():
  default = KernelOptions()
  assert (default.mosaic_forward_grid, default.mosaic_forward_registers,
          default.mosaic_backward_registers, default.mosaic_producer_registers) == (
              "auto", 240, 232, 40)
  assert not default.dq_after_dkv and default.mosaic_paired_products
  assert not default.mosaic_backward_id_rings and default.triton_tiles == ""
  assert hash(default) == hash(KernelOptions())  # a static jit key
  assert KernelOptions(mosaic_backward_registers=240).mosaic_producer_registers == 24
  bad = [(dict(mosaic_forward_grid="1"), ValueError, r"mosaic_forward_grid='1': expected one of"),
         (dict(mosaic_backward_registers=236), ValueError, "mosaic_backward_registers=236"),
         (dict(mosaic_backward_registers=264), ValueError, "mosaic_backward_registers=264"),
         (dict(mosaic_backward_registers=True), ValueError, "mosaic_backward_registers=True"),
         (dict(mosaic_forward_registers=244), ValueError, "mosaic_forward_registers=244"),
         (dict(mosaic_forward_registers=248), ValueError, "mosaic_forward_registers=248"),
         (dict(mosaic_forward_registers=240.0), ValueError, "mosaic_forward_registers=240.0"),
         (dict(dq_after_dkv=1), TypeError, "dq_after_dkv=1: expected True or False"),
         (dict(mosaic_paired_products="no"), TypeError, "mosaic_paired_products='no'"),
         (dict(triton_tiles=None), TypeError, "triton_tiles=None: expected a string"),
         (dict(triton_tiles="fwd=128,64,8,0"), ValueError, "four positive integers")]
  for fields, error, message in bad:
    with pytest.raises(error, match=message):
      KernelOptions(**fields)
  assert options.triton_tile_parts("fwd=128,64,8,3;gqa=inplace") == {"fwd": "128,64,8,3",
                                                                      "gqa": "inplace"}
  with pytest.raises(TypeError, match="kernel_options must be a kvax_plugin.KernelOptions"):
    options.kernel_options("fast")
  assert options.kernel_options(None) == default


def test_kernel_options_ignored_by_backends_without_them():
  """Options of one backend are ignored by the others (the JAX backend takes none): one object
  can serve a model whichever backend "auto" picks."""
  import jax.numpy as jnp
  import numpy as np
  import kvax_plugin
  seg = jnp.zeros((1, 32), jnp.int32)
  pos = jnp.arange(32, dtype=jnp.int32)[None]
  mask = kvax_plugin.create_attention_mask(pos, seg, pos, seg)
  x = jnp.ones((1, 32, 2, 16))
  plain = kvax_plugin.flash_attention(x, x, x, pos, seg, pos, seg, mask, backend="jax")
  tuned = kvax_plugin.flash_attention(
      x, x, x, pos, seg, pos, seg, mask, backend="jax",
      kernel_options=KernelOptions(mosaic_forward_grid="per_tile", triton_tiles="fwd=16,16,4,1"))
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(tuned))


def test_kernel_options_reach_the_backend_under_context_parallelism(monkeypatch):
  """On a mesh the op runs the backend per shard (sharded.run_sharded):
  the backend's own config reaches it there too, built from the flat KernelOptions and the
  memory_optimized_gqa_backward keyword. The registry is told "triton" runs here and its
  function is a recorder around the JAX backend (no GPU needed)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh
  import kvax_plugin
  from kvax_plugin.attention import kernels
  cpus = jax.devices("cpu")
  if len(cpus) < 2:
    pytest.skip("needs 2 CPU devices (tests/conftest.py sets 8)")
  real_availability = kernels.availability
  monkeypatch.setattr(kernels, "availability", lambda name: (
      (True, "pretend GPU") if name == "triton" else real_availability(name)))
  real = kernels.backend_function("jax")
  seen = []

  def recording(*args, kernel_options=None, **kwargs):
    seen.append(kernel_options)
    return real(*args, **kwargs)
  monkeypatch.setattr(kernels, "backend_function", lambda name: recording)
  mesh = Mesh(np.array(cpus[:2]), ("context",))
  specs = dict(mesh=mesh, query_specs=(None, "context", None, None),
               kv_specs=(None, None, None, None), token_order="natural")
  seg = jnp.zeros((1, 64), jnp.int32)
  pos = jnp.arange(64, dtype=jnp.int32)[None]
  x = jnp.ones((1, 64, 2, 16))
  mask = kvax_plugin.create_attention_mask(pos, seg, pos, seg, **specs)
  flat = KernelOptions(dq_after_dkv=True, mosaic_forward_grid="per_tile")
  kvax_plugin.flash_attention(x, x, x, pos, seg, pos, seg, mask, backend="triton",
                              kernel_options=flat, memory_optimized_gqa_backward=True,
                              **specs)
  want = options.TritonOptions(dq_after_dkv=True, memory_optimized_gqa_backward=True)
  assert seen and all(o == want for o in seen), seen


def test_per_backend_configs_check_their_fields_by_name():
  """MosaicOptions / HopperOptions / TritonOptions are frozen, hashable (a static jit key),
  default to exactly KernelOptions' defaults, and refuse a bad value naming Class.field, the
  value and what is expected."""
  import dataclasses
  flat = KernelOptions()
  for name, cls in options.BACKEND_OPTIONS.items():
    assert flat.for_backend(name) == cls(), name  # the same defaults, field for field
    assert hash(cls()) == hash(cls())
    with pytest.raises(dataclasses.FrozenInstanceError):
      setattr(cls(), next(iter(cls.FLAT)), None)
  bad = [(options.MosaicOptions, dict(forward_grid="1"), ValueError,
          r"MosaicOptions.forward_grid='1': expected one of \('auto', 'persistent', 'per_tile'\)"),
         (options.MosaicOptions, dict(forward_overlap_blocks=-1), ValueError,
          r"MosaicOptions.forward_overlap_blocks=-1: expected None \(the measured default\) or "
          r"an integer >= 0"),
         (options.MosaicOptions, dict(backward_registers=236), ValueError,
          "MosaicOptions.backward_registers=236: expected a multiple of 8"),
         (options.MosaicOptions, dict(paired_products="no"), TypeError,
          "MosaicOptions.paired_products='no': expected True or False"),
         (options.MosaicOptions, dict(dq_after_dkv=1), TypeError,
          "MosaicOptions.dq_after_dkv=1: expected True or False"),
         (options.HopperOptions, dict(forward_registers=248), ValueError,
          "HopperOptions.forward_registers=248: expected a multiple of 8"),
         (options.HopperOptions, dict(forward_grid=None), ValueError,
          "HopperOptions.forward_grid=None: expected one of"),
         (options.TritonOptions, dict(tiles=None), TypeError,
          "TritonOptions.tiles=None: expected a string"),
         (options.TritonOptions, dict(tiles="fwd=128,64,8,0"), ValueError,
          r"TritonOptions.tiles='fwd=128,64,8,0': fwd='128,64,8,0': expected four positive"),
         (options.TritonOptions, dict(memory_optimized_gqa_backward=1), TypeError,
          "TritonOptions.memory_optimized_gqa_backward=1: expected True or False")]
  for cls, fields, error, message in bad:
    with pytest.raises(error, match=message):
      cls(**fields)


def test_kernel_options_round_trip_through_the_per_backend_configs():
  """KernelOptions -> for_backend(each) -> from_backends gives the same flat options back, and
  each per-backend config survives the way through the flat form; configs that disagree on a
  shared flat field, and the Triton field with no flat form, are refused by name."""
  tuned = KernelOptions(mosaic_forward_grid="per_tile", mosaic_forward_overlap_blocks=0,
                        mosaic_forward_registers=232, dq_after_dkv=True,
                        mosaic_backward_registers=240, mosaic_paired_products=False,
                        mosaic_backward_id_rings=True, triton_tiles="fwd=64,64,4,2;gqa=perhead")
  for flat in (KernelOptions(), tuned):
    configs = [flat.for_backend(n) for n in options.BACKEND_OPTIONS]
    assert KernelOptions.from_backends(*configs) == flat
  mosaic = tuned.for_backend("mosaic")
  assert (mosaic.forward_grid, mosaic.backward_registers, mosaic.paired_products,
          mosaic.backward_id_rings, mosaic.dq_after_dkv) == ("per_tile", 240, False, True, True)
  assert tuned.for_backend("hopper") == options.HopperOptions("per_tile", 0, 232)
  assert tuned.for_backend("hopper").mosaic_forward() == options.MosaicOptions("per_tile", 0, 232)
  assert tuned.for_backend("triton") == options.TritonOptions("fwd=64,64,4,2;gqa=perhead", True)
  assert tuned.for_backend("jax") is None and tuned.for_backend("reference") is None
  for name, config in (("mosaic", mosaic), ("hopper", tuned.for_backend("hopper")),
                       ("triton", tuned.for_backend("triton"))):
    assert KernelOptions.from_backends(config).for_backend(name) == config
  with pytest.raises(ValueError, match="no kernel backend 'cuda'"):
    tuned.for_backend("cuda")
  with pytest.raises(ValueError, match=r"MosaicOptions.dq_after_dkv=True and "
                                       r"TritonOptions.dq_after_dkv=False set one field, "
                                       r"KernelOptions.dq_after_dkv"):
    KernelOptions.from_backends(options.MosaicOptions(dq_after_dkv=True), options.TritonOptions())
  with pytest.raises(ValueError, match="TritonOptions.memory_optimized_gqa_backward=True has no "
                                       "KernelOptions field"):
    KernelOptions.from_backends(options.TritonOptions(memory_optimized_gqa_backward=True))
  with pytest.raises(TypeError, match="KernelOptions.from_backends takes MosaicOptions"):
    KernelOptions.from_backends(tuned)


def test_each_backend_receives_only_its_own_config():
  """kernels.backend_options, the one place the registry hands tuning to a backend: whatever
  kernel_options was (flat, one config, a tuple of them, None), a backend gets its own typed
  config (its defaults when none of the given ones is its own), the keyword
  memory_optimized_gqa_backward lands in Triton's, and a backend without tuning gets none."""
  from kvax_plugin.attention import kernels
  mosaic = options.MosaicOptions(forward_grid="per_tile", paired_products=False)
  triton = options.TritonOptions(tiles="fwd=64,64,4,2")
  hopper = options.HopperOptions(forward_overlap_blocks=0)

  def given(name, kernel_options, **kw):
    return kernels.backend_options(name, kernel_options=kernel_options, **kw)["kernel_options"]
  for name, cls in options.BACKEND_OPTIONS.items():
    assert given(name, None) == cls()
    assert type(given(name, KernelOptions(dq_after_dkv=name != "hopper"))) is cls
  assert given("mosaic", mosaic) is mosaic and given("triton", mosaic) == options.TritonOptions()
  assert given("hopper", mosaic) == options.HopperOptions()  # not its own: its defaults
  both = (mosaic, triton, hopper)
  assert (given("mosaic", both), given("triton", both), given("hopper", both)) == both
  assert given("triton", triton, memory_optimized_gqa_backward=True) == options.TritonOptions(
      tiles="fwd=64,64,4,2", memory_optimized_gqa_backward=True)
  assert given("mosaic", None, memory_optimized_gqa_backward=True) == options.MosaicOptions()
  assert kernels.backend_options("jax", kernel_options=mosaic, deterministic_backward=True,
                                 memory_optimized_gqa_backward=True) == {}
  assert kernels.backend_options("mosaic", kernel_options=mosaic,
                                 deterministic_backward=False) == {
                                     "deterministic_backward": False, "kernel_options": mosaic}
  for wrong in ({"forward_grid": "per_tile"}, (mosaic, mosaic), [mosaic]):
    with pytest.raises(TypeError, match="kernel_options must be a kvax_plugin.KernelOptions, a "
                                        "per-backend config"):
      given("mosaic", wrong)


def test_per_backend_config_through_the_public_op():
  """flash_attention(kernel_options=<per-backend config or tuple>) runs (options of a backend
  that does not run are ignored, as with the flat form) and gives the plain result; a wrong
  type is refused before anything runs."""
  import jax.numpy as jnp
  import numpy as np
  import kvax_plugin
  seg = jnp.zeros((1, 32), jnp.int32)
  pos = jnp.arange(32, dtype=jnp.int32)[None]
  mask = kvax_plugin.create_attention_mask(pos, seg, pos, seg)
  x = jnp.ones((1, 32, 2, 16))
  plain = np.asarray(kvax_plugin.flash_attention(x, x, x, pos, seg, pos, seg, mask, backend="jax"))
  for tuning in (kvax_plugin.MosaicOptions(forward_grid="per_tile"),
                 (kvax_plugin.TritonOptions(tiles="fwd=16,16,4,1"), kvax_plugin.HopperOptions())):
    out = kvax_plugin.flash_attention(x, x, x, pos, seg, pos, seg, mask, backend="jax",
                                      kernel_options=tuning)
    np.testing.assert_array_equal(plain, np.asarray(out))
  with pytest.raises(TypeError, match="kernel_options must be"):
    kvax_plugin.flash_attention(x, x, x, pos, seg, pos, seg, mask, backend="jax",
                                kernel_options="per_tile")


def test_per_backend_defaults_are_the_flat_defaults():
  # Three classes spell the defaults; they must be one set of numbers.
  flat = KernelOptions()
  for name, cls in (("mosaic", options.MosaicOptions), ("hopper", options.HopperOptions),
                    ("triton", options.TritonOptions)):
    assert flat.for_backend(name) == cls(), name
    for field, flat_field in cls.FLAT.items():
      assert getattr(cls(), field) == getattr(flat, flat_field), (name, field)
