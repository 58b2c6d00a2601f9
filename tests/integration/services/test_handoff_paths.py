"""The KV handoff through real services on the packaged SmolLM2: every transport, both push modes,
block-size conversion, prefix reuse across prefill instances, and the failure paths (nothing leaks).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from prometheus_client import generate_latest

from proto.baton.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.decode.main import start as start_decode
from services.decode.settings import DecodeSettings
from services.kv_transfer.main import start as start_kv
from services.kv_transfer.settings import KVTransferSettings
from services.prefill.main import start as start_prefill
from services.prefill.settings import PrefillSettings
from shared.engine.request import SamplingParams
from shared.grpc_common import channel
from shared.service.engine_metrics import engine_registry
from shared.tokenizer import encode_prompt
from shared.transport import available_transports
from shared.wire import sampling_params_to_proto
from tests.helpers.models import packaged, packaged_engine

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
CAPABILITY = "test-capability"  # the handoff secret a router would choose
ENGINE: dict[str, Any] = dict(model=MODEL, port=0, metrics_port=-1, kv_cache_bytes=64 << 20, max_model_len=1024)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


@dataclass
class Stack:
    kv: Any
    prefills: list[Any]
    decode: Any
    _ids: list[int] = field(default_factory=lambda: [0])
    decode_cached: list[int] = field(default_factory=list)  # per generate: prompt tokens decode had already

    def stub(self, prefill_index: int = 0) -> prefill_pb2_grpc.PrefillServiceStub:
        return prefill_pb2_grpc.PrefillServiceStub(channel(self.prefills[prefill_index].address))

    async def prefill(self, prompt: list[int], params: SamplingParams, prefill_index: int = 0
                      ) -> tuple[common_pb2.GenerateRequest, prefill_pb2.PrefillResponse]:
        self._ids[0] += 1
        request_id = f"r{self._ids[0]}"
        req = common_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                         params=sampling_params_to_proto(params))
        first = await self.stub(prefill_index).Prefill(prefill_pb2.PrefillRequest(
            request=req, handoff_id=f"h-{request_id}", kv_transfer_address=self.kv.address, handoff_capability=CAPABILITY))
        return req, first

    async def generate(self, prompt: list[int], params: SamplingParams = GREEDY, prefill_index: int = 0
                       ) -> tuple[list[int], int]:
        """Generated tokens and the prompt tokens prefill did not compute."""
        req, first = await self.prefill(prompt, params, prefill_index)
        tokens = [first.first_token_id]
        if first.finish_reason:
            return tokens, first.num_cached_tokens
        stub = decode_pb2_grpc.DecodeServiceStub(channel(self.decode.address))
        cached = -1
        async for msg in stub.Generate(decode_pb2.DecodeRequest(
                request=req, handoff_id=f"h-{req.request_id}", kv_transfer_address=self.kv.address, handoff_capability=CAPABILITY,
                first_token_id=first.first_token_id)):
            tokens.extend(msg.token_ids)
            cached = msg.num_cached_tokens
        self.decode_cached.append(cached)
        return tokens, first.num_cached_tokens

    def engines(self) -> list[Any]:
        return [p.host.aengine.engine for p in self.prefills] + [self.decode.host.aengine.engine]

    async def assert_nothing_leaked(self) -> None:
        for _ in range(100):
            idle = all(not e.has_unfinished() and e.num_free_kv_blocks == e.num_kv_blocks for e in self.engines())
            if idle and self.kv.store.active_leases == 0:
                break
            await asyncio.sleep(0.05)
        for engine in self.engines():
            engine.check_no_leaks()
        self.kv.store.check_no_leaks()


def run(body: Any, *, transport: str = "tcp", num_prefills: int = 1, prefill: dict[str, Any] | None = None,
        decode: dict[str, Any] | None = None, kv: dict[str, Any] | None = None) -> Any:
    async def main() -> Any:
        kv_service = await start_kv(KVTransferSettings(port=0, metrics_port=-1, transport=transport,
                                                       capacity_bytes=256 << 20, **(kv or {})))
        prefills = [await start_prefill(PrefillSettings(**{**ENGINE, **(prefill or {})}))
                    for _ in range(num_prefills)]
        decode_service = await start_decode(DecodeSettings(**{**ENGINE, "kv_claim_wait_s": 2.0, **(decode or {})}))
        stack = Stack(kv_service, prefills, decode_service)
        try:
            return await body(stack)
        finally:  # what the stack holds now: a test may have stopped or replaced a service
            for service in (stack.decode, *stack.prefills, stack.kv):
                await service.stop()

    return asyncio.run(main())


def prompts() -> list[list[int]]:
    tok = packaged(MODEL).tokenizer
    questions = ["What is the capital of France?", "Write a short poem about the sea and the wind over it."]
    return [encode_prompt(tok, q, chat=True) for q in questions]


def expected(prompt_list: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [r.token_ids for r in packaged_engine(MODEL, max_model_len=1024).generate(prompt_list, params)]


@pytest.mark.parametrize("transport", available_transports())
def test_greedy_is_identical_to_colocated_with_every_transport(transport: str) -> None:
    ps = prompts()

    async def body(stack: Stack) -> list[list[int]]:
        got = await asyncio.gather(*(stack.generate(p) for p in ps))
        await stack.assert_nothing_leaked()
        return [tokens for tokens, _ in got]

    assert run(body, transport=transport) == expected(ps)


@pytest.mark.parametrize("case", ["after_prefill", "decode_block_32", "decode_block_8", "aux_hidden_layers"])
def test_push_after_prefill_and_block_size_conversion(case: str) -> None:
    """The baseline push mode, a decode engine whose blocks are not prefill's (converted on receive), and
    hidden states three layers wide (EAGLE-3 style auxiliary layers)."""
    ps = prompts()
    prefill: dict[str, Any] = {"kv_push_mode": "after_prefill"} if case == "after_prefill" else {}
    if case == "aux_hidden_layers":
        prefill["aux_hidden_layers"] = (2, 14)
    decode = {"block_size": int(case.rsplit("_", 1)[1])} if case.startswith("decode_block") else {}

    async def body(stack: Stack) -> list[list[int]]:
        got = [await stack.generate(p) for p in ps]
        await stack.assert_nothing_leaked()
        return [tokens for tokens, _ in got]

    assert run(body, prefill=prefill, decode=decode) == expected(ps)


def test_second_turn_computes_only_new_tokens_even_on_another_prefill() -> None:
    tok = packaged(MODEL).tokenizer
    turn1 = encode_prompt(tok, "Tell me about the moon.", chat=True)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    answer = expected([turn1], params)[0]
    turn2 = turn1 + answer + encode_prompt(tok, "And the sun?", chat=True)

    async def body(stack: Stack) -> tuple[list[int], int, int]:
        tokens1, cached1 = await stack.generate(turn1, params, prefill_index=0)
        assert tokens1 == answer and cached1 == 0
        tokens2, cached2 = await stack.generate(turn2, params, prefill_index=1)  # the other prefill
        # decode read only what its own prefix cache lacked: turn 1 (and its reply) was already there
        assert stack.decode_cached[-1] >= (len(turn1) // 16) * 16
        imported = stack.prefills[1].host.aengine.engine.remote.stats.imported_tokens
        await stack.assert_nothing_leaked()
        text = generate_latest(engine_registry(stack.prefills[1].host.aengine, "prefill")).decode()
        assert f'baton_prefix_pool_imported_tokens_total{{role="prefill"}} {float(imported)}' in text
        assert 'baton_kv_transfer_seconds_count{direction="push",role="prefill"} 1.0' in text
        assert 'baton_kv_transfer_failures_total{direction="push",role="prefill"} 0.0' in text
        return tokens2, cached2, imported

    tokens2, cached2, imported = run(body, num_prefills=2)
    full_blocks = (len(turn1) // 16) * 16
    assert cached2 >= full_blocks and imported >= full_blocks  # turn 1's prompt came from the pool
    assert tokens2 == expected([turn2], params)[0]


def test_decode_never_claiming_lets_the_lease_expire() -> None:
    async def body(stack: Stack) -> None:
        _, first = await stack.prefill(prompts()[0], GREEDY)
        assert not first.finish_reason and stack.kv.store.active_leases == 1
        await stack.assert_nothing_leaked()  # lease timeout 0.5 s

    run(body, kv={"lease_timeout_s": 0.5})


def test_prefill_stopping_mid_push_gives_decode_a_clear_error() -> None:
    long_prompt = list(range(1000, 1900))

    async def body(stack: Stack) -> str:
        pending = asyncio.create_task(stack.prefill(long_prompt, GREEDY))
        await asyncio.sleep(0.3)  # prefill is computing and writing
        await stack.prefills[0].stop()
        with pytest.raises(grpc.aio.AioRpcError):
            await pending
        stub = decode_pb2_grpc.DecodeServiceStub(channel(stack.decode.address))
        req = common_pb2.GenerateRequest(request_id="r1", prompt_token_ids=long_prompt,
                                         params=sampling_params_to_proto(GREEDY))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Generate(decode_pb2.DecodeRequest(
                    request=req, handoff_id="h-r1", kv_transfer_address=stack.kv.address, handoff_capability=CAPABILITY)):
                pass
        stack.prefills.clear()  # stopped already
        await stack.assert_nothing_leaked()
        return err.value.code().name

    assert run(body, prefill={"shutdown_grace_s": 0.0}) == "NOT_FOUND"


def test_kv_transfer_restart_fails_in_flight_requests_and_serves_new_ones() -> None:
    ps = prompts()

    async def body(stack: Stack) -> list[int]:
        await stack.generate(ps[0])
        port = int(stack.kv.address.rsplit(":", 1)[1])
        in_flight = asyncio.create_task(stack.prefill(list(range(1000, 1900)), GREEDY))
        await asyncio.sleep(0.5)  # reserved, computing, writing
        await stack.kv.stop()
        started = asyncio.get_running_loop().time()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await in_flight
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert asyncio.get_running_loop().time() - started < 30
        stack.kv = await start_kv(KVTransferSettings(port=port, metrics_port=-1, transport="tcp",
                                                     capacity_bytes=256 << 20))
        tokens, _ = await stack.generate(ps[1])  # engines link to the new agent
        await stack.assert_nothing_leaked()
        return tokens

    assert run(body, kv={"shutdown_grace_s": 0.0}) == expected([ps[1]])[0]


def test_prompts_that_wait_longer_than_the_lease_keep_it_by_renewing() -> None:
    """A 1 s lease, prompts that take seconds to compute and queue behind each other: none expires."""
    long_prompts = [list(range(1000 + 300 * i, 1000 + 300 * i + 700)) for i in range(2)]
    params = SamplingParams(max_tokens=4, temperature=0.0)

    async def body(stack: Stack) -> list[list[int]]:
        got = await asyncio.gather(*(stack.generate(p, params) for p in long_prompts))
        await stack.assert_nothing_leaked()
        return [tokens for tokens, _ in got]

    result = run(body, prefill={"max_num_seqs": 1}, kv={"lease_timeout_s": 1.0})
    assert result == expected(long_prompts, params)
