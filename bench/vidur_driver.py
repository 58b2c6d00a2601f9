"""Vidur (Microsoft's LLM-serving simulator, PyPI `vidur`) run on baton's measured step times.

Runs inside Vidur's own virtual environment (bench/vidur_compare.py makes it and calls this file as a
script), so it imports nothing of baton's: its input is a JSON file of the engine's fitted curves and a
trace, its output a JSON file of each request's TTFT and TPOT as Vidur simulates them.

    input  {"fits": {"prefill": [a, b, c], "decode": [a, b, c], "decode_lines": [[batch, a, c], ...] or null},
            "num_layers": L, "requests":
            [[arrival_s, prompt_tokens, output_tokens], ...], "num_blocks": N, "block_size": B,
            "chunk_size": C, "max_num_seqs": S}
    output {"requests": [[ttft_s, tpot_s], ...]}

Vidur's execution-time predictor is trained on per-operator GPU profiles downloaded from the Hugging Face
hub; this machine reaches no hub, and a CPU has no such profile. It is replaced by one that returns the
step time baton's profile measured (`step_s`, the formula of EngineCurves.mixed_step_s), booked as one
per-layer operator so that Vidur's own totals add it up. Everything else (the Sarathi chunked-prefill
scheduler, its batching, KV block accounting, request lifecycle) is Vidur's.
"""

from __future__ import annotations

import csv
import json
import sys
import tempfile
from pathlib import Path
from typing import Any


def step_s(fits: dict[str, Any], num_prefill_tokens: int, batch: int, num_context_tokens: int) -> float:
    """One engine step: a prefill chunk plus a decode batch (EngineCurves.mixed_step_s, and a decode step
    between the measured batch sizes as profile.interpolated_decode_s, restated here because this file runs
    where baton is not installed; tests/unit/bench/test_vidur_compare.py holds them equal)."""
    pa, pb, pc = fits["prefill"]
    da, db, dc = fits["decode"]
    lines = fits.get("decode_lines")
    if num_prefill_tokens <= 0 and batch > 0 and lines:
        per_request = num_context_tokens / batch
        k = 0
        while k < len(lines) - 2 and batch > lines[k + 1][0]:
            k += 1
        (b0, a0, c0), (b1, a1, c1) = lines[k], lines[k + 1]
        if batch <= b0:
            return a0 + c0 * num_context_tokens
        s0, s1 = a0 + c0 * b0 * per_request, a1 + c1 * b1 * per_request
        return max(0.0, s0 + (s1 - s0) * (batch - b0) / (b1 - b0))
    if num_prefill_tokens <= 0:
        return da + db * batch + dc * num_context_tokens if batch else 0.0
    tokens = num_prefill_tokens + batch
    prefill = pa + pb * tokens + pc * tokens * tokens
    return prefill if batch <= 0 else prefill + dc * num_context_tokens


def run(spec: dict[str, Any]) -> list[list[float]]:  # pragma: no cover (needs Vidur's environment)
    from vidur._native.entities import ExecutionTime as ExecutionTimeC
    from vidur.config import (
        CacheConfig,
        ClusterConfig,
        LinearRegressionExecutionTimePredictorConfig,
        MetricsConfig,
        ReplicaConfig,
        SarathiSchedulerConfig,
        SimulationConfig,
        TraceRequestGeneratorConfig,
    )
    from vidur.events import RequestArrivalEvent
    from vidur.execution_time_predictor.base_execution_time_predictor import BaseExecutionTimePredictor
    from vidur.execution_time_predictor.execution_time_predictor_registry import (
        ExecutionTimePredictorRegistry,
    )
    from vidur.simulator import Simulator
    from vidur.types import ExecutionTimePredictorType

    fits = spec["fits"]

    class MeasuredStepPredictor(BaseExecutionTimePredictor):
        """A step's time from baton's profile: prompt tokens of the step, decode batch, their context."""

        def get_execution_time(self, batch: Any, pipeline_stage: int) -> Any:
            prefill = decode = context = 0
            for request, q in zip(batch.requests, batch.num_q_tokens, strict=True):
                if request.is_prefill_complete:
                    decode += 1
                    context += request.num_processed_tokens
                else:
                    prefill += q
            # Vidur books operator times in milliseconds
            per_layer = step_s(fits, prefill, decode, context) * 1e3 / self._num_layers_per_pipeline_stage
            return ExecutionTimeC(self._num_layers_per_pipeline_stage, *([0.0] * 6), per_layer, *([0.0] * 7))

    # get_execution_time above is the only entry point: the per-operator getters it would call are never reached
    MeasuredStepPredictor.__abstractmethods__ = frozenset()
    ExecutionTimePredictorRegistry.unregister(ExecutionTimePredictorType.LINEAR_REGRESSION)
    ExecutionTimePredictorRegistry.register(ExecutionTimePredictorType.LINEAR_REGRESSION, MeasuredStepPredictor)

    work = Path(tempfile.mkdtemp(prefix="vidur-"))
    trace = work / "trace.csv"
    with trace.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Date", "Time", "PromptTokenCount", "CompletionTokenCount"])
        for arrival_s, prompt, output in spec["requests"]:
            writer.writerow(["baton", arrival_s, prompt, output])
    config = SimulationConfig(
        cluster_config=ClusterConfig(
            num_replicas=1,
            # the model and device only size Vidur's memory planning, which num_blocks overrides
            replica_config=ReplicaConfig(model_name="meta-llama/Llama-2-7b-hf", device="a100",
                                         num_pipeline_stages=1, tensor_parallel_size=1),
            cache_config=CacheConfig(block_size=spec["block_size"], num_blocks=spec["num_blocks"]),
            replica_scheduler_config=SarathiSchedulerConfig(batch_size_cap=spec["max_num_seqs"],
                                                            chunk_size=spec["chunk_size"]),
        ),
        request_generator_config=TraceRequestGeneratorConfig(
            trace_file=str(trace), date="baton", prefill_scale_factor=1.0, decode_scale_factor=1.0,
            time_scale_factor=1.0, max_tokens=1 << 20),
        execution_time_predictor_config=LinearRegressionExecutionTimePredictorConfig(),
        metrics_config=MetricsConfig(write_metrics=False, enable_chrome_trace=False, store_plots=False,
                                     output_dir=str(work / "out")),
    )
    simulator = Simulator(config)
    requests = sorted((event._request for _, event in simulator._event_queue
                       if isinstance(event, RequestArrivalEvent)), key=lambda r: r.arrived_at)
    simulator.run()
    out = []
    for r in requests:
        ttft = r.prefill_completed_at - r.arrived_at
        tpot = (r.completed_at - r.prefill_completed_at) / max(1, r.num_decode_tokens - 1)
        out.append([ttft, tpot])
    return out


def main() -> int:  # pragma: no cover
    spec = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps({"requests": run(spec)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
