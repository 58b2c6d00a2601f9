"""The handoff's cost against its bytes, through real services: kv_transfer, a prefill and a decode service.

```
 for each prompt length L (fresh random prompt, no prefix hit):
   Prefill(L) on the prefill service ──► reply after its KV is committed in kv_transfer   (timed: rpc_s)
   push_s = rpc_s − the engine's own prefill step at L (EngineCurves.prefill_step_s)
   Generate(handoff) on the decode service, 2 tokens ──► decode claims, reads the KV, decodes one token
                                                          (timed to that token: first_s)
   pull_s = first_s − the engine's own decode step at batch 1 and context L (EngineCurves.decode_step_s)
   nbytes = prefill's pushed bytes
```

All three run in this process on 127.0.0.1 (gRPC, the transport kv_transfer picks), as
bench/handoff_ttft.py runs them; each request is alone, so only one engine computes at a time.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from proto.baton.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from shared.engine.request import SamplingParams
from shared.grpc_common import channel
from shared.planner.profile import EngineCurves, HandoffCurves
from shared.wire import sampling_params_to_proto

logger = logging.getLogger(__name__)
CAPABILITY = "profile-capability"  # the handoff secret a router would choose


def _request(request_id: str, prompt: list[int], max_tokens: int) -> common_pb2.GenerateRequest:
    params = sampling_params_to_proto(SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return common_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, params=params)


def _direction(service: Any, direction: str) -> tuple[float, int]:
    stats = service.host.aengine.engine.remote.stats.by_direction[direction]
    return stats.sum_s, stats.nbytes


class _Run(NamedTuple):
    rpc_s: float  # the prefill's Prefill call, compute and push
    nbytes: int  # bytes pushed
    first_s: float  # decode's Generate to its first token: claim, read and one step
    pull_s: float  # the read alone, as the decode's transfer stats timed it


async def _one_handoff(services: dict[str, Any], request_id: str, prompt: list[int]) -> _Run:
    """One request through prefill, kv_transfer and decode, timed end to end and by the transfer stats.

    The decode side is timed to its first token, as the push side to the prefill's reply: what a client waits
    between its first two tokens is the claim, the read and the router's second call, not the read alone
    (14-18 ms at 64-256 tokens on 2 cores where the read alone was 3-11, 2026-11-27). The read's own time is
    the pull's floor: the end-to-end time less a step from the compute curves went to 0 on a CI machine whose
    curves overestimated a step. The push has no such floor: it writes layers while later ones compute
    (shared/engine/kv_push.py), so its own timer spans the compute (190 ms for a 64-token prompt on 2 cores,
    2026-11-27), and flooring by it doubled a quick plan_validate's predicted 1P1D TTFT."""
    prefill, decode, kv = services["prefill"], services["decode"], services["kv"]
    pushed_before = _direction(prefill, "push")[1]
    pull_before = _direction(decode, "pull")[0]
    handoff_id = f"h-{request_id}"
    stub = prefill_pb2_grpc.PrefillServiceStub(channel(prefill.address))
    started = time.perf_counter()
    reply = await stub.Prefill(prefill_pb2.PrefillRequest(
        request=_request(request_id, prompt, 2), handoff_id=handoff_id, kv_transfer_address=kv.address,
        handoff_capability=CAPABILITY))
    rpc_s = time.perf_counter() - started
    dstub = decode_pb2_grpc.DecodeServiceStub(channel(decode.address))
    started = time.perf_counter()
    call = dstub.Generate(decode_pb2.DecodeRequest(
        request=_request(request_id, prompt, 2), handoff_id=handoff_id, kv_transfer_address=kv.address,
        first_token_id=reply.first_token_id, handoff_capability=CAPABILITY))
    first_s = None
    async for message in call:
        if first_s is None and message.token_ids:
            first_s = time.perf_counter() - started
        if message.finished:
            break
    if first_s is None:  # the prompt asked for 2 tokens: decode owes the second
        raise RuntimeError(f"profile: request {request_id}: the decode service sent no token")
    return _Run(rpc_s=rpc_s, nbytes=_direction(prefill, "push")[1] - pushed_before, first_s=first_s,
                pull_s=_direction(decode, "pull")[0] - pull_before)


async def _start(model: str, max_model_len: int, threads: int, transport: str) -> dict[str, Any]:
    from services.decode.main import start as start_decode
    from services.decode.settings import DecodeSettings
    from services.kv_transfer.main import start as start_kv
    from services.kv_transfer.settings import KVTransferSettings
    from services.prefill.main import start as start_prefill
    from services.prefill.settings import PrefillSettings

    engine: dict[str, Any] = dict(model=model, port=0, metrics_port=-1, kv_cache_bytes=512 << 20,
                                  max_model_len=max_model_len, torch_threads=threads)
    services: dict[str, Any] = {}
    try:
        services["kv"] = await start_kv(KVTransferSettings(port=0, metrics_port=-1, transport=transport,
                                                           capacity_bytes=1 << 30, lease_timeout_s=120.0))
        logger.info("profile: kv_transfer up (%s); starting prefill and decode services ...",
                    services["kv"].transport.kind)
        services["prefill"] = await start_prefill(PrefillSettings(**engine))
        services["decode"] = await start_decode(DecodeSettings(**engine, role="decode"))
    except BaseException:
        await _stop(services)
        raise
    return services


async def _stop(services: dict[str, Any]) -> None:
    for name in ("decode", "prefill", "kv"):
        if name in services:
            await services[name].stop()


async def measure_handoff(model: str, lengths: Sequence[int], repeats: int, threads: int,
                          compute: EngineCurves, transport: str = "auto") -> tuple[HandoffCurves, int]:
    """The handoff sweep; returns its curves and the bytes one prompt token's KV takes on the wire."""
    services = await _start(model, max(lengths) + 256, threads, transport)
    curves = HandoffCurves(transport=services["kv"].transport.kind)
    rng = random.Random(7)
    vocab = services["decode"].host.aengine.engine.loaded.spec.vocab_size
    bytes_per_token: list[float] = []
    try:
        await _one_handoff(services, "warm", [rng.randrange(100, vocab) for _ in range(32)])
        for length in lengths:
            runs = []
            for r in range(repeats):
                prompt = [rng.randrange(100, vocab) for _ in range(length)]
                runs.append(await _one_handoff(services, f"h{length}-{r}", prompt))
            rpc_s = statistics.median(run.rpc_s for run in runs)
            nbytes = int(statistics.median(run.nbytes for run in runs))
            pull_s = max(statistics.median(run.pull_s for run in runs),
                         statistics.median(run.first_s for run in runs) - compute.decode_step_s(1, length))
            push_s = max(0.0, rpc_s - compute.prefill_step_s(length))
            curves.points.append([nbytes, push_s, pull_s])
            bytes_per_token.append(nbytes / length)
            logger.info("profile: handoff of %d tokens (%d bytes, %s): prefill reply %.1f ms (%.1f ms beyond "
                        "compute), decode's first token %.1f ms beyond its step", length, nbytes,
                        curves.transport, rpc_s * 1e3, push_s * 1e3, pull_s * 1e3)
    finally:
        await _stop(services)
    curves.refit()
    return curves, round(statistics.median(bytes_per_token))


def measure_handoff_sync(model: str, lengths: Sequence[int], repeats: int, threads: int,
                         compute: EngineCurves, transport: str = "auto") -> tuple[HandoffCurves, int]:
    return asyncio.run(measure_handoff(model, lengths, repeats, threads, compute, transport))
