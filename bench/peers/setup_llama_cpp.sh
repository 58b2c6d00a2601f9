#!/usr/bin/env bash
# Set up llama-cpp-python's OpenAI-compatible server in its own venv, outside the repo tree.
#
#   bench/peers/setup_llama_cpp.sh [VENV]      # default ~/.cache/baton/peers/llamacpp-venv
#
# PyPI ships llama-cpp-python as source only: pip compiles llama.cpp (CPU, this machine's
# instruction set), about 6 minutes on 2 cores. It serves the packaged GGUF as it is (Q4_1),
# one request at a time. Idempotent: a finished venv is left as it is.
set -euo pipefail

source "$(dirname "$0")/venv.sh"

VENV="${1:-${BATON_PEERS_DIR:-$HOME/.cache/baton/peers}/llamacpp-venv}"
LLAMA_CPP_VERSION=0.3.36

peer_venv_begin llama-cpp-python "$VENV"
"$VENV/bin/pip" install --quiet "llama-cpp-python[server]==$LLAMA_CPP_VERSION"
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
peer_venv_done llama-cpp-python "$VENV"
