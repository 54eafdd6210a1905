#!/usr/bin/env bash
# Create .venv with Python >= 3.12 and install kvax-plugin with the pinned versions.
# Finds python3.12 / python3.13 on PATH or through pyenv; stops with a clear message if none.
set -euo pipefail
cd "$(dirname "$0")/.."
# dev + maxtext + triton: the integration suite (integration/, marked maxtext) runs against
# MaxText 0.2.5, and triton + jax-triton let the kernels run on CPU through Triton's interpreter
# (tests/test_triton_interpret.py); without a GPU, backend="auto" still resolves to "jax".
# Not `gpu`: its nvcc (~350 MB to download) serves only the opt-in real CUDA compile of
# tests/test_cuda_sm90_build.py (KVAX_EXTRAS=dev,maxtext,gpu and KVAX_TEST_NVCC=1).
# A fresh install of dev + maxtext took 3m20s on a 2-core machine without a pip cache.
EXTRAS=${KVAX_EXTRAS:-dev,maxtext,triton}
# Another environment (scripts/bootstrap_levanter.sh: Levanter cannot share one with MaxText).
VENV=${KVAX_VENV:-.venv}
CONSTRAINTS=${KVAX_CONSTRAINTS:-constraints.txt}

find_python() {
  local c
  for c in "${KVAX_PYTHON:-}" python3.12 python3.13 python3; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1 || [ -d "${PYENV_ROOT:-$HOME/.pyenv}/versions" ]; then
    for c in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python; do
      [ -x "$c" ] && { echo "$c"; return 0; }
    done
  fi
  return 1
}

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 12))'; then
  if ! PY=$(find_python); then
    echo "kvax-plugin needs Python >= 3.12 (jax >= 0.11, maxtext). None was found on PATH" >&2
    echo "(python3.12, python3.13) or under pyenv (\$PYENV_ROOT/versions/3.12*)." >&2
    echo "Install one (e.g. 'pyenv install 3.12') or set KVAX_PYTHON=/path/to/python3.12." >&2
    exit 1
  fi
  echo "bootstrap: creating $VENV with $PY ($("$PY" --version))"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.installed-$(cat "$CONSTRAINTS" setup.cfg | sha1sum | cut -c1-12)-$EXTRAS"
if [ ! -f "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # pip byte-compiles what it installs one file at a time; compileall does it on every core.
  # On a 2-core machine that makes a fresh install of dev + maxtext + triton about a fifth
  # faster.
  "$VENV/bin/python" -m pip install -q --no-compile -c "$CONSTRAINTS" -e ".[$EXTRAS]"
  # Its exit status is ignored as pip ignores it: some packages ship files that are not Python
  # 3 on purpose (test data), and a file left uncompiled is compiled when imported.
  # KVAX_PRECOMPILE=0 skips it: an environment set up while tests run (scripts/test.sh) leaves
  # the cores to them and compiles only what it imports.
  if [ "${KVAX_PRECOMPILE:-1}" != 0 ]; then
    "$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
  fi
  rm -f "$VENV"/.installed-*; touch "$stamp"
fi
