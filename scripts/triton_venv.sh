#!/usr/bin/env bash
# A venv in which the Triton server bundled by the nvidia-pytriton wheel runs Vocalis' Python-backend model.
# It must come from Debian's system python3 (the bundled stub fails under pyenv builds) and hold numpy<2.
#   scripts/triton_venv.sh /tmp/vocalis-triton-venv
#   VOCALIS_TRITON_VENV=/tmp/vocalis-triton-venv python -m pytest tests/test_serve_triton.py
set -euo pipefail
venv="${1:?usage: $0 VENV_DIR}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
/usr/bin/python3 -m venv "$venv"
"$venv/bin/pip" install -q "numpy<2" nvidia-pytriton
"$venv/bin/pip" install -q "numpy<2" -e "$repo"
echo "ready: VOCALIS_TRITON_VENV=$venv"
