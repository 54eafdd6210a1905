"""A short Levanter training run with attn_backend=kvax on the shipped packed text.

Levanter's Trainer, on the 4 simulated CPU devices this suite runs with (Levanter's default mesh
puts them all on the data axis, so kvax runs sharded over the batch), through
kvax_plugin.integrations.levanter.train_packed: progress lines, a falling loss, masks built
only at the decoder entry, nothing routed to Levanter's attention.
"""

from __future__ import annotations

import jax


def test_short_training_run(kvax_levanter, seam_counts, tmp_path, capsys):
  from kvax_plugin.integrations.levanter import train_packed
  steps = 6
  lines = train_packed.main(["--steps", str(steps), "--seq_len", "128", "--batch_size", "4",
                             "--block", "32", "--out", str(tmp_path)])
  out = capsys.readouterr().out
  assert [line.step for line in lines] == list(range(1, steps + 1))
  for line in lines:
    assert line.format(steps) in out
    assert 0 < line.real_tokens <= line.tokens and 0.0 < line.skipped < 1.0
  assert lines[-1].loss < lines[0].loss - 0.5, [line.loss for line in lines]
  assert "blocks skipped" in out and "kvax while tracing" in out
  counts = dict(seam_counts)
  assert counts["entries"] >= 1 and counts["entry_masks"] == counts["entries"], counts
  assert counts["per_call_masks"] == 0 and counts["routed"] == 0, counts
  if jax.device_count() > 1:
    assert counts["sharded_calls"] == counts["layer_calls"] >= 1, counts
