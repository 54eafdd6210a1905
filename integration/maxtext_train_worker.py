"""A few real steps through MaxText's own training entry point (run as a subprocess).

    python integration/maxtext_train_worker.py METRICS_FILE <MaxText train argv...>

Calls kvax_plugin.integrations.maxtext.train.main (install() + MaxText's train.main), then
prints one JSON line with the per-step losses MaxText wrote and the kvax trace counters, so the
caller can tell the kernel really ran.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
  metrics_file, argv = sys.argv[1], sys.argv[2:]
  from kvax_plugin.providers import kvax_provider
  from kvax_plugin.integrations.maxtext import train
  train.main([sys.argv[0]] + argv + [f"metrics_file={metrics_file}"])
  with open(metrics_file) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  losses = [r["learning/loss"] for r in sorted(rows, key=lambda r: r["step"])]
  print("KVAX_RESULT " + json.dumps(dict(losses=losses, trace_counts=dict(kvax_provider.TRACE_COUNTS))),
        flush=True)


if __name__ == "__main__":
  main()
