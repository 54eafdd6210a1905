#!/usr/bin/env bash
# The test command: set up (idempotent) and run the CPU test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m pytest -q "$@"
