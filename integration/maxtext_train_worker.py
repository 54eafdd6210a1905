"""Real steps through MaxText's own training entry point, one run after another (a subprocess).

    python integration/maxtext_train_worker.py '[["METRICS_FILE", [<MaxText train argv...>]], ...]'

Calls kvax_plugin.integrations.maxtext.train.main (install() + MaxText's train.main) once per
run, in this one process (one MaxText import, ~10 s of CPU, for all the runs), then prints one
JSON line per run with the per-step losses MaxText wrote and what that run did to the kvax
trace counters, so the caller can tell the kernel really ran (or, for other attentions, did not).
"""

from __future__ import annotations

import json
import sys


def main() -> None:
  from kvax_plugin.providers import kvax_provider
  from kvax_plugin.integrations.maxtext import train
  for metrics_file, argv in json.loads(sys.argv[1]):
    before = dict(kvax_provider.TRACE_COUNTS)
    train.main([sys.argv[0]] + argv + [f"metrics_file={metrics_file}"])
    with open(metrics_file) as f:
      rows = [json.loads(line) for line in f if line.strip()]
    losses = [r["learning/loss"] for r in sorted(rows, key=lambda r: r["step"])]
    counts = {k: v - before.get(k, 0) for k, v in kvax_provider.TRACE_COUNTS.items()}
    print("KVAX_RESULT " + json.dumps(dict(losses=losses, trace_counts=counts)), flush=True)


if __name__ == "__main__":
  main()
