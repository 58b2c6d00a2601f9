"""TTFT of a long prompt: colocated vs disaggregated with layer-wise push vs pushing after prefill.

All three run as real services in this process (gRPC on 127.0.0.1, kv_transfer
over the chosen transport), one request at a time, so only one engine computes
at any moment:

- colocated: a decode service in the colocated role; TTFT = its first streamed token.
- layerwise: Prefill on a prefill service that writes each layer's blocks as the layer finishes;
  TTFT = the Prefill reply (sent after the KV is committed in kv_transfer: the first token reaches
  the client only once decode could take over).
- after_prefill: the same, but the prefill writes every block only after its last layer.

Then a second chat turn (turn 1's prompt plus 100 tokens) goes to the other prefill instance:
its TTFT and the tokens it read from kv_transfer's prefix pool instead of computing them.

Each iteration sends the three a fresh random prompt (no prefix hits) in rotating order;
medians are reported with the ratios to colocated. Target: layerwise within 10% of colocated.

    python bench/handoff_ttft.py [--quick] [--tokens 2000] [--transport nixl]

Also run by `bench/kv_transfer.py --ttft`. The JSON result is the last line on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from typing import Any

from proto.baton.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.decode.main import start as start_decode
from services.decode.settings import DecodeSettings
from services.kv_transfer.main import start as start_kv
from services.kv_transfer.settings import KVTransferSettings
from services.prefill.main import start as start_prefill
from services.prefill.settings import PrefillSettings
from shared.engine.request import SamplingParams
from shared.grpc_common import channel
from shared.transport import available_transports
from shared.wire import sampling_params_to_proto

TARGET_RATIO = 1.10
CAPABILITY = "bench-capability"  # the handoff secret a router would choose


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _request(request_id: str, prompt: list[int]) -> common_pb2.GenerateRequest:
    params = sampling_params_to_proto(SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    return common_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, params=params)


async def _colocated_ttft(stub: decode_pb2_grpc.DecodeServiceStub, request_id: str, prompt: list[int]) -> float:
    started = time.perf_counter()
    call = stub.Generate(decode_pb2.DecodeRequest(request=_request(request_id, prompt)))
    async for _ in call:
        ttft = time.perf_counter() - started
        call.cancel()
        return ttft
    raise RuntimeError("the colocated stream ended without a token")


async def _disagg_ttft(stub: prefill_pb2_grpc.PrefillServiceStub, kv_address: str, request_id: str,
                       prompt: list[int]) -> float:
    started = time.perf_counter()
    await stub.Prefill(prefill_pb2.PrefillRequest(request=_request(request_id, prompt), handoff_id=f"h-{request_id}",
                                                  kv_transfer_address=kv_address, handoff_capability=CAPABILITY))
    return time.perf_counter() - started


async def measure(model: str, num_tokens: int, iterations: int, transport: str) -> dict[str, Any]:
    engine: dict[str, Any] = dict(model=model, port=0, metrics_port=-1, kv_cache_bytes=512 << 20,
                                  max_model_len=max(4096, num_tokens + 256), max_num_batched_tokens=num_tokens + 256)
    kv = await start_kv(KVTransferSettings(port=0, metrics_port=-1, transport=transport, capacity_bytes=2 << 30,
                                           lease_timeout_s=120.0))
    services: list[Any] = [kv]
    try:
        log("starting colocated, layer-wise prefill and after-prefill prefill ...")
        colocated = await start_decode(DecodeSettings(**engine, role="colocated"))
        services.append(colocated)
        layerwise = await start_prefill(PrefillSettings(**engine, kv_push_mode="layerwise"))
        services.append(layerwise)
        after = await start_prefill(PrefillSettings(**engine, kv_push_mode="after_prefill"))
        services.append(after)
        runners = {
            "colocated": lambda rid, p: _colocated_ttft(decode_pb2_grpc.DecodeServiceStub(
                channel(colocated.address)), rid, p),
            "layerwise": lambda rid, p: _disagg_ttft(prefill_pb2_grpc.PrefillServiceStub(
                channel(layerwise.address)), kv.address, rid, p),
            "after_prefill": lambda rid, p: _disagg_ttft(prefill_pb2_grpc.PrefillServiceStub(
                channel(after.address)), kv.address, rid, p),
        }
        rng = random.Random(0)
        vocab = colocated.host.aengine.engine.loaded.spec.vocab_size
        samples: dict[str, list[float]] = {name: [] for name in runners}
        names = list(runners)
        for it in range(iterations + 1):  # iteration 0 warms every path up and is dropped
            order = names[it % 3:] + names[:it % 3]
            for name in order:
                prompt = [rng.randrange(10, vocab) for _ in range(num_tokens)]
                ttft = await runners[name](f"{name}-{it}", prompt)
                if it:
                    samples[name].append(ttft)
                log(f"  iteration {it}{' (warm-up)' if not it else ''}: {name:13s} TTFT {ttft * 1000:8.1f} ms")
        medians = {name: statistics.median(v) for name, v in samples.items()}
        base = medians["colocated"]
        reuse = await _prefix_reuse(runners, rng, vocab, num_tokens, layerwise, after)
        return {
            "num_prompt_tokens": num_tokens, "iterations": iterations, "transport": kv.transport.kind,
            "ttft_ms_median": {k: round(v * 1000, 1) for k, v in medians.items()},
            "ttft_ms_all": {k: [round(x * 1000, 1) for x in v] for k, v in samples.items()},
            "ratio_to_colocated": {k: round(v / base, 3) for k, v in medians.items()},
            "target_layerwise_ratio": TARGET_RATIO,
            "meets_target": medians["layerwise"] / base <= TARGET_RATIO,
            "prefix_reuse": reuse,
        }
    finally:
        for service in reversed(services):
            await service.stop()


async def _prefix_reuse(runners: dict[str, Any], rng: random.Random, vocab: int, num_tokens: int,
                        first: Any, second: Any) -> dict[str, Any]:
    """A second chat turn (the first turn's prompt plus 100 tokens) on the OTHER prefill instance."""
    turn1 = [rng.randrange(10, vocab) for _ in range(num_tokens)]
    turn2 = turn1 + [rng.randrange(10, vocab) for _ in range(100)]
    before = second.host.aengine.engine.remote.stats.imported_tokens
    t1 = await runners["layerwise"]("turn-1", turn1)
    t2 = await runners["after_prefill"]("turn-2", turn2)
    imported = second.host.aengine.engine.remote.stats.imported_tokens - before
    log(f"  prefix reuse: turn 1 ({len(turn1)} tokens) {t1 * 1000:.1f} ms; turn 2 ({len(turn2)} tokens, other "
        f"prefill) {t2 * 1000:.1f} ms, {imported} tokens read from the pool")
    return {"turn1_tokens": len(turn1), "turn1_ttft_ms": round(t1 * 1000, 1), "turn2_tokens": len(turn2),
            "turn2_ttft_ms_other_prefill": round(t2 * 1000, 1), "turn2_imported_tokens": imported,
            "turn2_over_turn1": round(t2 / t1, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 iterations instead of 5")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--transport", default=available_transports()[0])
    args = parser.parse_args()
    result = asyncio.run(measure(args.model, args.tokens, 2 if args.quick else 5, args.transport))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
