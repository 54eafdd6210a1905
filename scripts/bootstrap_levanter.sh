#!/usr/bin/env bash
# Create .venv-levanter: kvax-plugin with the [levanter] extra (marin-levanter + marin-haliax),
# pinned by constraints-levanter.txt. Levanter cannot share .venv with MaxText's extras (it needs
# optax < 0.2.7, tensorstore < 0.1.85, safetensors < 0.7), so it gets its own environment; the
# Python lookup and the install stamp are scripts/bootstrap.sh's.
set -euo pipefail
cd "$(dirname "$0")/.."
KVAX_VENV=.venv-levanter KVAX_CONSTRAINTS=constraints-levanter.txt KVAX_EXTRAS=dev,levanter \
  exec bash scripts/bootstrap.sh
