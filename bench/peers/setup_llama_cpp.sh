#!/usr/bin/env bash
# Set up llama-cpp-python's OpenAI-compatible server in its own venv, outside the repo tree.
#
#   bench/peers/setup_llama_cpp.sh [VENV]      # default ~/.cache/baton/peers/llamacpp-venv
#
# PyPI ships llama-cpp-python as source only: pip compiles llama.cpp (CPU, this machine's
# instruction set), about 6 minutes on 2 cores. It serves the packaged GGUF as it is (Q4_1),
# one request at a time. Idempotent: a finished venv is left as it is.
set -euo pipefail

VENV="${1:-${BATON_PEERS_DIR:-$HOME/.cache/baton/peers}/llamacpp-venv}"
PYTHON="${PYTHON:-python3.11}"
LLAMA_CPP_VERSION=0.3.36

if [[ -f "$VENV/.installed" ]]; then
    echo "llama-cpp-python venv ready: $VENV"
    exit 0
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/pip" install --quiet "llama-cpp-python[server]==$LLAMA_CPP_VERSION"
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
touch "$VENV/.installed"
