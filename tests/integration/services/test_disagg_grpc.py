"""prefill -> kv_transfer -> decode over real gRPC in one process, on the packaged SmolLM2."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from proto.baton.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.decode.main import start as start_decode
from services.decode.settings import DecodeSettings
from services.kv_transfer.main import start as start_kv
from services.kv_transfer.settings import KVTransferSettings
from services.prefill.main import start as start_prefill
from services.prefill.settings import PrefillSettings
from shared.engine.request import SamplingParams
from shared.grpc_common import channel
from shared.tokenizer import encode_prompt
from shared.wire import sampling_params_to_proto
from tests.helpers.models import packaged, packaged_engine

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
CAPABILITY = "test-capability"  # the handoff secret a router would choose
ENGINE = dict(model=MODEL, port=0, metrics_port=-1, kv_cache_bytes=64 << 20, max_model_len=1024,
              kv_claim_wait_s=0.5)


class Stack:
    def __init__(self, kv: Any, prefill: Any, decode: Any) -> None:
        self.kv, self.prefill, self.decode = kv, prefill, decode
        self.prefill_stub = prefill_pb2_grpc.PrefillServiceStub(channel(prefill.address))
        self.decode_stub = decode_pb2_grpc.DecodeServiceStub(channel(decode.address))

    async def generate(self, prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
        req, handoff_id, first = await self.prefill_only(prompt, params)
        tokens = [first.first_token_id]
        if first.finish_reason:
            return tokens, first.finish_reason
        finish = ""
        async for msg in self.decode_stream(req, handoff_id, first.first_token_id):
            tokens.extend(msg.token_ids)
            finish = msg.finish_reason
        return tokens, finish

    async def prefill_only(self, prompt: list[int], params: SamplingParams
                      ) -> tuple[common_pb2.GenerateRequest, str, prefill_pb2.PrefillResponse]:
        """The prefill half: its handoff waits in kv_transfer for `decode_stream`."""
        request_id = uuid.uuid4().hex
        req = common_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                         params=sampling_params_to_proto(params))
        handoff_id = f"h-{request_id}"
        first = await self.prefill_stub.Prefill(prefill_pb2.PrefillRequest(
            request=req, handoff_id=handoff_id, kv_transfer_address=self.kv.address, handoff_capability=CAPABILITY))
        return req, handoff_id, first

    def decode_stream(self, req: common_pb2.GenerateRequest, handoff_id: str, first_token_id: int
               ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        return self.decode_stub.Generate(decode_pb2.DecodeRequest(
            request=req, handoff_id=handoff_id, kv_transfer_address=self.kv.address, handoff_capability=CAPABILITY,
            first_token_id=first_token_id))

    def engines_idle(self) -> bool:
        return all(e.num_free_kv_blocks == e.num_kv_blocks and not e.has_unfinished()
                   for e in (self.prefill.host.aengine.engine, self.decode.host.aengine.engine))


async def _start() -> Stack:
    kv = await start_kv(KVTransferSettings(port=0, metrics_port=-1, max_claim_wait_s=1.0))
    prefill = await start_prefill(PrefillSettings(**ENGINE))
    decode = await start_decode(DecodeSettings(**ENGINE))
    return Stack(kv, prefill, decode)


async def _stop(stack: Stack) -> None:
    for s in (stack.decode, stack.prefill, stack.kv):
        await s.stop()


def run(coro_fn: Any) -> Any:
    async def main() -> Any:
        stack = await _start()
        try:
            return await coro_fn(stack)
        finally:
            await _stop(stack)

    return asyncio.run(main())


async def backend_for(stack: Stack, dead_prefill: str | None = None, kv_transfer: str | None = None,
                      **backend: Any) -> Any:
    """The router's gRPC backend over the stack's instances (and a dead prefill listed first, if given;
    `kv_transfer`: the address registered for it instead of the stack's)."""
    import time

    from services.router.grpc_backend import GrpcBackend
    from services.router.instance_cache import InstanceCache
    from shared.registry.base import InstanceInfo, Load
    from shared.registry.memory_registry import MemoryRegistry

    registry = MemoryRegistry()

    def info(service: str, instance_id: str, address: str) -> InstanceInfo:
        return InstanceInfo(service, instance_id, address, "", MODEL, Load(0, 0, 100, 100), time.time())

    if dead_prefill is not None:
        await registry.register(info("prefill", "a-dead", dead_prefill), 60)
    await registry.register(info("prefill", "b-live", stack.prefill.address), 60)
    await registry.register(info("decode", "d", stack.decode.address), 60)
    await registry.register(info("kv_transfer", "kv", kv_transfer or stack.kv.address), 60)
    cache = InstanceCache(registry)
    await cache.refresh()
    return GrpcBackend(cache, **backend)


QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about rain.",
             "What is 12 times 12?"]


def test_disaggregated_greedy_equals_colocated() -> None:
    tok = packaged(MODEL).tokenizer
    prompts = [encode_prompt(tok, q, chat=True) for q in QUESTIONS]
    params = [SamplingParams(max_tokens=24, temperature=0.0), SamplingParams(max_tokens=1, temperature=0.0),
              SamplingParams(max_tokens=20, temperature=0.8, seed=42), SamplingParams(max_tokens=16, temperature=0.0)]
    expected = packaged_engine(MODEL, max_model_len=1024).generate(prompts, params)

    async def body(stack: Stack) -> list[tuple[list[int], str]]:
        got = await asyncio.gather(*(stack.generate(p, sp) for p, sp in zip(prompts, params, strict=True)))
        await asyncio.sleep(0.2)
        assert stack.engines_idle()
        assert stack.kv.store.active_leases == 0
        return got

    got = run(body)
    for (tokens, finish), exp in zip(got, expected, strict=True):
        assert tokens == exp.token_ids
        assert finish == exp.finish_reason


def test_cancelled_decode_stream_frees_everything() -> None:
    prompt = encode_prompt(packaged(MODEL).tokenizer, "Tell me a long story about dragons.", chat=True)

    async def body(stack: Stack) -> None:
        req = common_pb2.GenerateRequest(request_id="cancel-me", prompt_token_ids=prompt,
                                         params=sampling_params_to_proto(SamplingParams(max_tokens=500,
                                                                                        ignore_eos=True)))
        first = await stack.prefill_stub.Prefill(prefill_pb2.PrefillRequest(
            request=req, handoff_id="h-cancel", kv_transfer_address=stack.kv.address, handoff_capability=CAPABILITY))
        call = stack.decode_stub.Generate(decode_pb2.DecodeRequest(
            request=req, handoff_id="h-cancel", kv_transfer_address=stack.kv.address, handoff_capability=CAPABILITY,
            first_token_id=first.first_token_id))
        n = 0
        async for _ in call:
            n += 1
            if n == 3:
                call.cancel()
                break
        for _ in range(100):
            if stack.engines_idle():
                break
            await asyncio.sleep(0.05)
        assert stack.engines_idle()

    run(body)


def test_errors_are_grpc_statuses() -> None:
    async def body(stack: Stack) -> None:
        bad = common_pb2.GenerateRequest(request_id="bad", prompt_token_ids=[1, 2],
                                         params=common_pb2.SamplingParams(max_tokens=0))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stack.prefill_stub.Prefill(prefill_pb2.PrefillRequest(
                request=bad, handoff_id="h", kv_transfer_address=stack.kv.address, handoff_capability=CAPABILITY))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        ok = common_pb2.GenerateRequest(request_id="lost", prompt_token_ids=[1, 2],
                                        params=sampling_params_to_proto(SamplingParams(max_tokens=4)))
        with pytest.raises(grpc.aio.AioRpcError) as e2:
            async for _ in stack.decode_stub.Generate(decode_pb2.DecodeRequest(
                    request=ok, handoff_id="never-stored", kv_transfer_address=stack.kv.address, handoff_capability=CAPABILITY,
                    first_token_id=5)):
                pass
        assert e2.value.code() == grpc.StatusCode.NOT_FOUND
        too_long = common_pb2.GenerateRequest(request_id="long", prompt_token_ids=[5] * 2000,
                                              params=sampling_params_to_proto(SamplingParams(max_tokens=4)))
        with pytest.raises(grpc.aio.AioRpcError) as e3:
            await stack.prefill_stub.Prefill(prefill_pb2.PrefillRequest(
                request=too_long, handoff_id="h2", kv_transfer_address=stack.kv.address, handoff_capability=CAPABILITY))
        assert e3.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert stack.engines_idle()

    run(body)



def test_router_backend_retries_a_dead_prefill_elsewhere() -> None:
    """The registry lists a dead prefill first; the request still succeeds on the live one."""
    from services.router.backend import BackendRequest
    from tests.helpers.redis_server import free_port

    prompt = encode_prompt(packaged(MODEL).tokenizer, "What is the capital of France?", chat=True)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    expected = packaged_engine(MODEL, max_model_len=1024).generate([prompt], params)[0].token_ids

    async def body(stack: Stack) -> list[int]:
        backend = await backend_for(stack, dead_prefill=f"127.0.0.1:{free_port()}")
        tokens: list[int] = []
        async for chunk in backend.generate(BackendRequest("retry-1", prompt, params)):
            tokens.extend(chunk.token_ids)
        await backend.close()
        return tokens

    assert run(body) == expected


def test_router_backend_spreads_requests_between_heartbeats() -> None:
    """With registry loads frozen (no heartbeat yet), the router's in-flight counts still spread prefills."""
    import time

    from services.router.grpc_backend import GrpcBackend
    from services.router.instance_cache import InstanceCache
    from shared.registry.base import InstanceInfo, Load
    from shared.registry.kv_picker import PromptBlocks
    from shared.registry.kv_summary import KVSummary
    from shared.registry.memory_registry import MemoryRegistry

    async def main() -> list[str]:
        registry = MemoryRegistry()
        for name in ("p0", "p1"):
            await registry.register(InstanceInfo("prefill", name, f"{name}:1", "", MODEL, Load(), time.time()), 60)
        cache = InstanceCache(registry)
        await cache.refresh()
        backend = GrpcBackend(cache)
        prompt = PromptBlocks([1, 2, 3])
        chosen = [backend.router.pick_prefill(cache.get("prefill"), prompt, KVSummary()).instance_id]
        with backend.router.hold("prefill", "p0"):
            chosen.append(backend.router.pick_prefill(cache.get("prefill"), prompt, KVSummary()).instance_id)
        chosen.append(backend.router.pick_prefill(cache.get("prefill"), prompt, KVSummary()).instance_id)
        await backend.close()
        return chosen

    assert asyncio.run(main()) == ["p0", "p1", "p0"]


def test_the_backend_counts_the_instances_it_can_send_work_to() -> None:
    """What the router's /health reports and `baton up` waits on before it says "baton ready"."""
    import time

    from services.router.grpc_backend import GrpcBackend
    from services.router.instance_cache import InstanceCache
    from shared.registry.base import InstanceInfo, Load
    from shared.registry.memory_registry import MemoryRegistry

    async def main() -> dict[str, int]:
        registry = MemoryRegistry()
        for name in ("d0", "d1"):
            await registry.register(InstanceInfo("decode", name, f"{name}:1", "", MODEL, Load(), time.time()), 60)
        await registry.register(InstanceInfo("prefill", "p0", "p0:1", "", MODEL, Load(), time.time()), 60)
        cache = InstanceCache(registry)
        await cache.refresh()
        backend = GrpcBackend(cache)
        counts = backend.instance_counts()
        await backend.close()
        return counts

    assert asyncio.run(main()) == {"prefill": 1, "decode": 2, "kv_transfer": 0, "colocated": 0, "encoder": 0}


def test_a_dead_kv_transfer_sends_the_prompt_to_a_decode_instance_or_fails_without_migration() -> None:
    """No token sent yet and the prefill path broken (its kv_transfer is gone): with migration on, the decode
    instance computes the prompt and the greedy tokens are the same; with --migration-limit 0, a 503."""
    from services.router.backend import BackendRequest
    from services.router.migration import MigrationPolicy
    from shared.errors import UnavailableError
    from tests.helpers.redis_server import free_port

    prompt = encode_prompt(packaged(MODEL).tokenizer, "What is the capital of France?", chat=True)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    expected = packaged_engine(MODEL, max_model_len=1024).generate([prompt], params)[0].token_ids
    dead = f"127.0.0.1:{free_port()}"

    async def generate(backend: Any, request_id: str) -> list[int]:
        tokens: list[int] = []
        async for chunk in backend.generate(BackendRequest(request_id, prompt, params)):
            tokens.extend(chunk.token_ids)
        return tokens

    async def body(stack: Stack) -> list[int]:
        backend = await backend_for(stack, kv_transfer=dead)
        tokens = await generate(backend, "fallback-1")
        assert backend.router.num_migrations == 1
        await backend.close()
        strict = await backend_for(stack, kv_transfer=dead, migration=MigrationPolicy(limit=0))
        with pytest.raises(UnavailableError):
            await generate(strict, "fallback-2")
        await strict.close()
        await asyncio.sleep(0.2)
        assert stack.engines_idle()
        return tokens

    assert run(body) == expected
