#!/usr/bin/env bash
# The main job: set up (idempotent) and run the demonstration. Extra args go to the program.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m kvax_plugin.demo "$@"
