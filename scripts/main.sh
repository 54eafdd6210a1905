#!/usr/bin/env bash
# The main job: set up (idempotent), then train the tiny Llama 3 in MaxText with attention=kvax on
# the shipped packed corpus (a few minutes on 2 CPU cores; on a GPU the same command takes the
# fastest backend there through kvax.backend=auto). Extra args go to the launcher, e.g.
#   scripts/main.sh --config.attention=dot_product
#   scripts/main.sh --config=gemma2:tiny --config.steps=20
# A --config=... among them replaces the default config. The attention-op demonstration without
# MaxText stays available as: .venv/bin/python -m kvax_plugin.demo
set -euo pipefail
cd "$(dirname "$0")/.."
# The launcher drives MaxText: install the [maxtext] extra with the dev tools.
KVAX_EXTRAS="${KVAX_EXTRAS:-dev,maxtext,gpu}" bash scripts/bootstrap.sh
config=(--config=llama3:tiny)
for arg in "$@"; do
  case "$arg" in --config=*|--config) config=() ;; esac
done
exec .venv/bin/python -m kvax_plugin.launch "${config[@]}" "$@"
