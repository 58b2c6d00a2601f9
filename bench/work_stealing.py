"""Whether a kernel's threads should take each other's last items, in one process.

The projection kernels split a weight's panels (csrc/w8a8_impl.h, gemv_bf16_impl.h below amx, qgemv_impl.h,
gemv_impl.h), and the paged decode kernel its (row, KV heads) jobs (csrc/paged_decode_impl.h), into one
contiguous range a thread; with `work_stealing` on (torch.ops.baton_cpu, the default) a thread done with its
range takes the items still left at the back of the others' (csrc/steal_for.h), so that the closing barrier
does not wait for the slower thread. For each row count, one pass over all the model's projections as a
decode step runs them (qkv, o, gate_up with its SiLU gate, down of every layer), off and on in turn within
each round (bench/kernel_switch.py); with --steps whole decode steps, with --prefill whole prefills of
256-token prompts, of an engine (int8 with a bf16 KV cache, as served; or bf16 weights, --precision bf16).
Reported: the median ms each way and the median over rounds of off / on (above 1: taking is faster). The
bits do not depend on it (tests/unit/ops/test_work_stealing.py).

    .venv/bin/python -m bench.work_stealing [--rows 1 8 16 32 64 256] [--rounds 9] [--steps --step-batch 8 32]
        [--prefill --prefill-batch 1 4]

Writes bench/results/work_stealing-<stamp>.json and prints it as the last line.
"""

from __future__ import annotations

import sys

from bench.kernel_switch import run_cli

# per precision: linear_precisions' name for its weights, the switch, the engine's flags
PRECISIONS = {
    "int8": ("int8-w8a8", "work_stealing", {"quantization": "int8", "kv_cache_dtype": "bfloat16"}),
    "bf16": ("bf16", "work_stealing", {"dtype": "bfloat16"}),
}

if __name__ == "__main__":
    sys.exit(run_cli("work_stealing", __doc__, PRECISIONS))
