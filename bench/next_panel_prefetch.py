"""Whether a decode batch's later passes over a weight panel should prefetch the next one, in one process.

A decode batch passes each panel of the W8A8 GEMM (six rows a pass, csrc/w8a8_impl.h) and of the bf16 GEMV
below the amx level (eight rows a pass, csrc/gemv_bf16_impl.h) several times. Only the first pass read the
panel from DRAM; the others computed from L1 while the memory bus idled. `w8a8_next_prefetch` and
`gemv_bf16_next_prefetch` (torch.ops.baton_cpu) turn on (and off) the later passes prefetching the thread's
next panel into L2. For each row count, one pass over all the model's projections as a decode step runs them
(qkv, o, gate_up with its SiLU gate, down of every layer: 106 MB for SmolLM2 in int8, 212 MB in bf16), with
the prefetch off and on in turn within each round, so that this machine's drift reaches both alike.
Reported: the median ms of a pass each way and the median over rounds of off / on (above 1: the prefetch is
faster). The bits do not depend on it (tests/unit/ops/test_w8a8.py, test_gemv_bf16.py). With --steps, whole
decode steps of an engine in that precision (bf16 KV cache, as served) at each --step-batch, off and on in
turn (bench/layer_loop.py's alternation).

    .venv/bin/python -m bench.next_panel_prefetch [--precision int8|bf16] [--rows 1 8 16 32 64 256] [--rounds 9]
        [--steps --step-batch 8 32]

Writes bench/results/next_panel_prefetch-<stamp>.json (w8a8_prefetch-* before it took bf16) and prints it
as the last line.
"""

from __future__ import annotations

import sys

from bench.kernel_switch import run_cli

# per precision: linear_precisions' name for its weights, the toggle, the engine's flags
PRECISIONS = {
    "int8": ("int8-w8a8", "w8a8_next_prefetch", {"quantization": "int8", "kv_cache_dtype": "bfloat16"}),
    "bf16": ("bf16", "gemv_bf16_next_prefetch", {"dtype": "bfloat16"}),
}


if __name__ == "__main__":
    sys.exit(run_cli("next_panel_prefetch", __doc__, PRECISIONS))
