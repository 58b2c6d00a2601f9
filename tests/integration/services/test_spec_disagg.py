"""Speculation on the disaggregated path: prefill -> kv_transfer -> speculating decode over real gRPC.

For every proposer, greedy output through the services equals the plain
colocated engine's (float-noise ties excepted, as in the fidelity tests). The
EAGLE head is untrained here (exactness never depends on its quality); its
prompt features arrive with the KV, and the decode engine's counters show
that every method verified drafts.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from services.decode.main import start as start_decode
from services.decode.settings import DecodeSettings
from services.kv_transfer.main import start as start_kv
from services.kv_transfer.settings import KVTransferSettings
from services.prefill.main import start as start_prefill
from services.prefill.settings import PrefillSettings
from shared.engine.request import SamplingParams
from shared.spec.eagle import target_lm_head
from shared.spec.eagle_head import EagleHead, EagleHeadConfig
from shared.tokenizer import encode_prompt
from tests.helpers.models import packaged, packaged_engine
from tests.integration.engine.test_spec_fidelity import assert_same_greedy
from tests.integration.services.test_disagg_grpc import ENGINE, MODEL, Stack

pytestmark = pytest.mark.slow

PROMPTS = ["Repeat exactly: the cat sat on the mat, the cat sat on the mat.", "What is the capital of France?",
           "Count from one to ten in words."]
TREE = "0;1;2;0.0;0.1;1.0;0.0.0;0.0.0.0"  # bench/spec_decode.py's default


def random_head(path: Path) -> Path:
    model = packaged(MODEL).model
    head = EagleHead(EagleHeadConfig.from_decoder_spec(model.spec), model.embed, target_lm_head(model),
                     generator=torch.Generator().manual_seed(0), draft_token_ids=torch.arange(4096))
    head.save(path)
    return path


@pytest.mark.parametrize(("method", "async_scheduling"),
                         [("ngram", False), ("draft", False), ("eagle", False), ("eagle-tree", False), ("ngram", True),
                          ("none", True), ("eagle-fp8kv", False)])
def test_speculating_decode_service_equals_plain_greedy(method: str, async_scheduling: bool, tmp_path: Path) -> None:
    """Each proposer (EAGLE also with a draft tree, and over an fp8 KV cache, whose handoff carries the hidden
    states in bf16); and decode's zero-bubble loop, plain and with ngram drafts proposed ahead."""
    tok = packaged(MODEL).tokenizer
    prompts = [encode_prompt(tok, p, chat=True) for p in PROMPTS]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    kv: dict[str, object] = {"kv_cache_dtype": "fp8"} if method.endswith("-fp8kv") else {}
    # over an fp8 cache the plain engine attends through the services' kernels: from avx512_bf16 up they round
    # the query and the weights to bf16 (csrc/bf16_pairs.h), which moves logits by more than float noise from
    # the torch reference's, and what this compares is speculation and the handoff, not the kernels
    expected = [r.token_ids for r in packaged_engine(MODEL, serving=bool(kv), max_model_len=1024, **kv)
                .generate(prompts, params)]
    spec: dict[str, object] = dict(spec=method.removesuffix("-tree").removesuffix("-fp8kv"), num_speculative_tokens=3,
                                   spec_draft_num_layers=2, async_scheduling=async_scheduling)
    if method.startswith("eagle"):
        spec["spec_eagle_head"] = random_head(tmp_path / "head.safetensors")
    if method == "eagle-tree":
        spec["spec_tree"] = TREE

    async def main() -> tuple[list[list[int]], int, int]:
        kv_transfer = await start_kv(KVTransferSettings(port=0, metrics_port=-1, max_claim_wait_s=1.0))
        prefill = await start_prefill(PrefillSettings(**ENGINE, **kv))  # type: ignore[arg-type]
        decode = await start_decode(DecodeSettings(**ENGINE, **kv, **spec))  # type: ignore[arg-type]
        stack = Stack(kv_transfer, prefill, decode)
        try:
            got = await asyncio.gather(*(stack.generate(p, params) for p in prompts))
            for _ in range(100):
                if stack.engines_idle():
                    break
                await asyncio.sleep(0.05)
            engine = decode.host.aengine.engine
            assert stack.engines_idle()
            assert engine.async_scheduling is async_scheduling
            if engine.speculator is None:
                return [tokens for tokens, _ in got], -1, 0
            engine.speculator.check_no_leaks()
            stats = engine.speculator.stats
            return [tokens for tokens, _ in got], stats.num_verifications, stats.num_draft_tokens
        finally:
            for s in (decode, prefill, kv_transfer):
                await s.stop()

    got, num_verifications, num_drafts = asyncio.run(main())
    for ours, theirs, prompt in zip(got, expected, prompts, strict=True):
        assert_same_greedy(ours, theirs, prompt)
    assert num_verifications > 0 or method == "none"
    if method == "eagle-tree":  # trees were verified: a chain holds at most 3 drafts, this tree 8
        assert num_drafts > 3 * num_verifications
