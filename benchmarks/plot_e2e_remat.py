"""Plot of session 13's MaxText e2e runs (benchmarks/results/e2e/s13_remat/): tokens/s of
attention=kvax and cudnn_flash_jax, 16k rows, by remat policy, before and after the residual
barrier (kernels/custom_vjp.saved_residuals). Each group is one device call (same machine).

    python benchmarks/plot_e2e_remat.py   # writes benchmarks/results/e2e/s13_remat/e2e_remat.png
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "e2e" / "s13_remat"
# (group label, result directory): one device call each
GROUPS = (
    ("one doc, full\nbefore fix", "e2e_remat_full"),
    ("one doc, minimal_with_context\nbefore fix", "e2e_remat_minimal_with_context"),
    ("one doc, minimal_w_c\nfix, kvax first", "e2e_fix_16k-long_kvax_16k-long_cudnn_flash_jax"),
    ("one doc, minimal_w_c\nfix, cuDNN first", "e2e_fix_16k-long_cudnn_flash_jax_16k-long_kvax"),
    ("short docs, minimal_w_c\nfix", "e2e_fix_16k-short_kvax_16k-short_cudnn_flash_jax"),
)


def tokens_per_s(directory: str) -> dict[str, float]:
  rows = json.loads((ROOT / directory / "e2e.json").read_text())["runs"]
  return {r["attention"]: r["tokens_per_s"] for r in rows if r.get("tokens_per_s")}


def main() -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(10, 4.2))
  width = 0.38
  for g, (label, directory) in enumerate(GROUPS):
    tps = tokens_per_s(directory)
    for i, (att, color) in enumerate((("kvax", "tab:blue"), ("cudnn_flash_jax", "tab:orange"))):
      v = tps.get(att, 0.0) / 1e3
      x = g + (i - 0.5) * width
      ax.bar(x, v, width, color=color, label=att if g == 0 else None)
      ax.text(x, v, f"{v:.1f}k", ha="center", va="bottom", fontsize=8)
    if tps.get("kvax") and tps.get("cudnn_flash_jax"):
      ax.text(g, 4, f"{tps['kvax'] / tps['cudnn_flash_jax']:.3f}x", ha="center", fontsize=9,
              color="white", fontweight="bold")
  ax.set_xticks(range(len(GROUPS)), [g[0] for g in GROUPS], fontsize=8)
  ax.set_ylabel("real tokens/s (thousands)")
  ax.set_title("MaxText llama3-8b (4 layers), 16k rows, one H200: kvax vs cudnn_flash_jax by "
               "remat policy (session 13)", fontsize=10)
  ax.legend(loc="upper left", fontsize=8)
  fig.tight_layout()
  out = ROOT / "e2e_remat.png"
  fig.savefig(out, dpi=120)
  print(out)


if __name__ == "__main__":
  main()
