#!/usr/bin/env bash
# Serve baton's SmolLM2 weights with vLLM's CPU build by hand (bench/serve.py does the same itself).
#
#   bench/peers/serve_vllm.sh [PORT]     # default 18100; Ctrl-C stops it
#
# Needs bench/peers/setup_vllm.sh first. The weights are `baton export-hf`'s dequantized fp32
# HF directory; fp32 because bf16 is far slower on this CPU. Health: GET /health after 2-5 minutes
# (torch.compile warm-up). vLLM binds its compute threads to all cores but one and leaves that one
# to its API server; binding both cores (VLLM_CPU_OMP_THREADS_BIND=0-1) was 3x slower here.
set -euo pipefail

PORT="${1:-18100}"
WORK="${BATON_BENCH_WORK:-$HOME/.cache/baton/bench-serve}"
VENV="${BATON_PEERS_DIR:-$HOME/.cache/baton/peers}/vllm-venv"
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
HF="$WORK/hf-smollm2-135m"

mkdir -p "$WORK/home"
test -f "$HF/config.json" || "$REPO/.venv/bin/baton" export-hf --model smollm2-135m --out "$HF"
export VLLM_CPU_KVCACHE_SPACE=4 VLLM_CACHE_ROOT="$WORK/vllm-cache" HF_HUB_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HOME="$WORK/home"
exec "$VENV/bin/vllm" serve "$HF" --served-model-name smollm2-135m --max-model-len 2048 \
    --dtype float32 --host 127.0.0.1 --port "$PORT"
