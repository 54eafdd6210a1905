#!/usr/bin/env bash
# What a user installs, on a GPU machine: the wheel built from this tree, installed outside it,
# imports every backend, reports no defect, and "auto" resolves and matches the float32
# reference through the installed package (on a Hopper GPU: "hopper", its CUDA backward built
# with nvcc on first use). Third-party wheels the image lacks come in /tmp/site (see
# tests/gpu/run_on_device.sh). Writes $OUT/installed_wheel_gpu.json.
#   bash tests/gpu/installed_wheel_gpu.sh [expected auto backend, default hopper]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
expect=${1:-hopper}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
work=$(mktemp -d)
"${PYTHON:-python3}" -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$root"
"${PYTHON:-python3}" -m pip install -q --no-deps --no-index --target "$work/site" "$work"/dist/*.whl
cd "$work"  # outside the tree: kvax_plugin can come only from the wheel
export PYTHONPATH="$work/site:/tmp/site"
"${PYTHON:-python3}" -m kvax_plugin.info --json > "$work/info.json"
"${PYTHON:-python3}" - "$work/info.json" "$expect" "$OUT/installed_wheel_gpu.json" <<'PY'
import json, sys
import jax, jax.numpy as jnp, numpy as np
import kvax_plugin as kvax
from kvax_plugin.attention.kernels import resolve_backend_for
info = json.load(open(sys.argv[1]))
expect, out_path = sys.argv[2], sys.argv[3]
assert "site" in kvax.__file__ and "/work" not in kvax.__file__, kvax.__file__
assert info["defects"] == [], info["defects"]
S, H, K, D = 2048 + 37, 8, 2, 128
rng = np.random.default_rng(0)
cuts = np.sort(rng.choice(np.arange(1, S - 100), 5, replace=False))
seg = np.full(S, -1, np.int32); pos = np.zeros(S, np.int32)
for i, (a, b) in enumerate(zip(np.r_[0, cuts], np.r_[cuts, S - 100])):
  seg[a:b] = i; pos[a:b] = np.arange(b - a)
seg, pos = jnp.asarray(np.stack([seg, seg])), jnp.asarray(np.stack([pos, pos]))
keys = jax.random.split(jax.random.PRNGKey(0), 3)
q = jax.random.normal(keys[0], (2, S, H, D), jnp.bfloat16)
k = jax.random.normal(keys[1], (2, S, K, D), jnp.bfloat16)
v = jax.random.normal(keys[2], (2, S, K, D), jnp.bfloat16)
mask = kvax.create_attention_mask(pos, seg, pos, seg, calc_bwd_mask=True)
chosen = resolve_backend_for("auto", jnp.bfloat16, D, D, ("causal", "gqa"), mask)
errors = kvax.compare_with_reference(q, k, v, pos, seg, pos, seg, mask, scale=D ** -0.5)
ok = chosen == expect and all(np.isfinite(x) for x in errors.values()) and all(
    errors[f"{n}_rel_l2"] < 2e-2 for n in ("out", "dq", "dk", "dv"))
result = {"kvax_file": kvax.__file__, "auto": chosen, "expected": expect, "errors": errors,
          "backends": {n: [b["available"], b["reason"]] for n, b in info["backends"].items()},
          "versions": info["versions"], "devices": info["devices"], "ok": bool(ok)}
json.dump(result, open(out_path, "w"), indent=1)
print(json.dumps(result, indent=1))
sys.exit(0 if ok else 1)
PY
