"""benchmarks/maxtext_scaling.py without GPUs: its run specs, the launcher command each becomes,
and the speed-up / loss comparison it reports (the GPU runs: benchmarks/results/*/maxtext_scaling)."""

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import maxtext_scaling as ms


def test_specs_name_mesh_processes_and_rows():
  r = ms.parse_spec("256k-short:kvax:c2f2p2")
  assert (r["seq_len"], r["layout"], r["attention"]) == (262144, "short", "kvax")
  assert r["mesh"] == {"ici_context": 2, "ici_fsdp": 2}
  assert (r["gpus"], r["processes"], r["rows"]) == (4, 2, 4)  # one row per GPU by default
  one = ms.parse_spec("1m-long:cudnn_flash_jax:1")
  assert (one["seq_len"], one["gpus"], one["rows"], one["mesh"]) == (1 << 20, 1, 1, {})
  assert ms.parse_spec("128k-short:kvax:c4:1")["rows"] == 1  # one row split over 4 GPUs
  lever = ms.parse_spec("256k-short:kvax:c4+kvax_kv_grad_reduce_dtype=input+kvax_backend=mosaic")
  assert lever["overrides"] == {"kvax_kv_grad_reduce_dtype": "input", "kvax_backend": "mosaic"}
  assert lever["mesh"] == {"ici_context": 4} and ms.parse_spec("256k-short:kvax:1")["overrides"] == {}
  for bad in ("128k:kvax:1", "128k-medium:kvax:1", "12x-short:kvax:1", "128k-short:kvax:c4q2",
              "128k-short:kvax:c4+novalue", "128k-short:kvax:c4+Bad-Key=1"):
    with pytest.raises(SystemExit, match="--runs"):
      ms.parse_spec(bad)


def test_run_sets_fill_their_hosts():
  """--runs 4gpu / 8gpu: every run fits the host it is named for, the multi-GPU runs use all of
  it (same tokens per GPU as the one-GPU runs of their length), and 8gpu has a run over 2
  processes and one row split over every GPU."""
  for name, gpus in (("4gpu", 4), ("8gpu", 8)):
    runs = [ms.parse_spec(s) for s in ms.RUN_SETS[name].split(",")]
    assert {r["gpus"] for r in runs} == {1, gpus}, name
    for r in runs:
      if r["gpus"] > 1 and r["rows"] == r["gpus"]:
        assert any(b["gpus"] == 1 and b["label"] == r["label"] for b in runs), r["spec"]
  eight = [ms.parse_spec(s) for s in ms.RUN_SETS["8gpu"].split(",")]
  assert any(r["processes"] == 2 and r["gpus"] == 8 for r in eight)
  assert any(r["rows"] == 1 and r["gpus"] == 8 for r in eight)
  assert ms.RUN_SETS["4gpu"] == ms.DEFAULT_RUNS


def test_launcher_command_carries_mesh_rows_and_layout():
  args = argparse.Namespace(variant="8b", steps=10, kvax_backend="auto", layers=4, vocab=512,
                            profile=False)
  run = ms.parse_spec("128k-long:kvax:c4:1")
  cmd = ms.launcher_cmd(run, args, Path("/tmp/x"), {"jax_cache_dir": "/tmp/j"})
  assert not any(c.startswith("profiler=") for c in cmd)
  profiled = argparse.Namespace(**vars(args), profile_skip=3, profile_steps=2)
  profiled.profile = True
  cmd_p = ms.launcher_cmd(run, profiled, Path("/tmp/x"), {"jax_cache_dir": "/tmp/j"})
  assert cmd_p[:len(cmd)] == cmd and cmd_p[len(cmd):] == [
      "profiler=xplane", "skip_first_n_steps_for_profiler=3", "profiler_steps=2"]
  assert "--config.mesh.ici_context=4" in cmd and "--config.mesh.ici_fsdp=1" in cmd
  assert "per_device_batch_size=0.25" in cmd and "--config.kvax.backend=auto" in cmd
  assert f"--config.data.min_doc_chars={4 * 131072}" in cmd  # long: one document per row
  assert "base_num_decoder_layers=4" in cmd and "vocab_size=512" in cmd
  lever = ms.launcher_cmd(ms.parse_spec("128k-short:kvax:c4+kvax_kv_grad_reduce_dtype=input"),
                          args, Path("/tmp/x"), {"jax_cache_dir": "/tmp/j"})
  assert "kvax_kv_grad_reduce_dtype=input" in lever


def test_compare_gives_speedup_efficiency_and_loss_gap():
  rows = [dict(ms.parse_spec("128k-short:kvax:1"), tokens_per_s=100.0, losses=[5.0, 4.0]),
          dict(ms.parse_spec("128k-short:kvax:c4"), tokens_per_s=340.0, losses=[5.1, 4.2]),
          dict(ms.parse_spec("128k-short:kvax:c4:1"), tokens_per_s=250.0, losses=[5.0, 4.05]),
          dict(ms.parse_spec("256k-short:kvax:c4"), error="exit [1]: RESOURCE_EXHAUSTED")]
  out = {c["run"]: c for c in ms.compare(rows)}
  assert out["128k-short:kvax:c4"]["speedup"] == 3.4
  assert out["128k-short:kvax:c4"]["efficiency"] == 0.85
  assert "max_loss_gap" not in out["128k-short:kvax:c4"]  # 4 rows against 1: other batches
  assert out["128k-short:kvax:c4:1"]["max_loss_gap"] == pytest.approx(0.05)
  assert "256k-short:kvax:c4" not in out  # a failed run has nothing to compare
  lever = dict(ms.parse_spec("128k-short:kvax:1+kvax_backend=mosaic"), tokens_per_s=50.0,
               losses=[5.0, 4.0])
  # A one-GPU row with overrides is not the baseline of the plain multi-GPU rows.
  assert {c["against"] for c in ms.compare([lever] + rows)} == {"128k-short:kvax:1"}


def test_versus_compares_kvax_with_other_attentions_at_the_same_settings():
  rows = [dict(ms.parse_spec("128k-short:kvax:c4"), tokens_per_s=300.0, losses=[5.0, 4.0]),
          dict(ms.parse_spec("128k-short:cudnn_flash_te:c4"), tokens_per_s=200.0,
               losses=[5.0, 4.1]),
          dict(ms.parse_spec("128k-short:cudnn_flash_te:c2f2"), tokens_per_s=100.0,
               losses=[5.0, 4.0]),
          dict(ms.parse_spec("128k-long:cudnn_flash_te:c4"), tokens_per_s=100.0,
               losses=[5.0, 4.0]),
          dict(ms.parse_spec("128k-short:flash:c4"), error="exit [1]: RESOURCE_EXHAUSTED")]
  out = ms.versus(rows)
  assert len(out) == 1  # other meshes, layouts and failed runs are not compared
  assert out[0]["against"] == "128k-short:cudnn_flash_te:c4"
  assert out[0]["kvax_speedup"] == 1.5 and out[0]["max_loss_gap"] == pytest.approx(0.1)


def test_replot_draws_the_losses_of_rows_on_the_same_batches(tmp_path, monkeypatch):
  """--replot redraws scaling.png from scaling.json; the loss panel shows the two attentions
  that trained on the same 4 rows, not only the one-GPU rows."""
  import matplotlib.pyplot as plt
  rows = [dict(ms.parse_spec("128k-short:kvax:c4"), tokens_per_s=300.0, losses=[5.0, 4.0]),
          dict(ms.parse_spec("128k-short:cudnn_flash_te:c4"), tokens_per_s=280.0,
               losses=[5.0, 4.1]),
          dict(ms.parse_spec("128k-long:kvax:c4"), tokens_per_s=80.0, losses=[6.0, 5.0])]
  (tmp_path / "scaling.json").write_text(json.dumps(dict(rows=rows, layers=4, device="4 x H200")))
  drawn = []

  def plot_and_read_its_lines(result, path, plot=ms.plot):
    plot(result, path)
    drawn.extend(line.get_label() for ax in plt.gcf().axes for line in ax.get_lines())
    plt.close("all")

  monkeypatch.setattr(ms, "plot", plot_and_read_its_lines)
  ms.main(["--replot", str(tmp_path)])
  assert (tmp_path / "scaling.png").stat().st_size > 0
  assert sorted(drawn) == ["128k-short cudnn_flash_te c4, 4 row(s)", "128k-short kvax c4, 4 row(s)"]


def test_transformer_engine_without_preallocation_is_warned_about():
  te = [ms.parse_spec("256k-short:cudnn_flash_te:c4"), ms.parse_spec("256k-short:kvax:c4")]
  kvax_only = te[1:]
  assert "cudnn_flash_te may run out of memory" in ms.preallocation_note("false", te)
  assert ms.preallocation_note("true", te) is None
  assert ms.preallocation_note("false", kvax_only) is None
