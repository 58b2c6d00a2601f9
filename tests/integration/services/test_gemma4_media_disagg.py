"""Images and audio through prefill -> kv_transfer -> decode over real gRPC (a tiny checkpoint with both towers,
written by `baton make-tiny gemma4 --vision --audio --bidirectional-vision`).

The encoder runs in the prefill service; the KV handoff and decode are the text path's. Greedy tokens equal
a colocated engine's and transformers'. kv_transfer's prefix pool keys blocks by the image too: the same
text with another image, prefilled on a second instance, imports only the block before the image, and the
first image sent again there imports nearly the whole prompt and answers the same. kv_transfer also keeps
the encoder outputs the prefills offer: an image another prefill encoded is not encoded again.
"""

from __future__ import annotations

import asyncio
import io
import uuid
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
import soundfile
from PIL import Image

from proto.baton.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    encoder_pb2,
    encoder_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services.decode.main import start as start_decode
from services.decode.settings import DecodeSettings
from services.encoder.main import start as start_encoder
from services.encoder.settings import EncoderSettings
from services.kv_transfer.main import start as start_kv
from services.kv_transfer.settings import KVTransferSettings
from services.prefill.main import start as start_prefill
from services.prefill.settings import PrefillSettings
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.request import SamplingParams
from shared.grpc_common import channel
from shared.multimodal.items import MediaItem
from shared.multimodal.loading import read_multimodal
from shared.multimodal.media import content_hash
from shared.wire import media_to_proto, sampling_params_to_proto
from tests.helpers.gemma4 import hf_from_checkpoint, tiny_gemma4_checkpoint
from tests.helpers.gemma4_mm import hf_mm_greedy, image_bytes, random_image, random_wave, wav_bytes

pytestmark = pytest.mark.slow

NUM_TOKENS = 8
CAPABILITY = "test-capability"  # the handoff secret a router would choose
PARAMS = SamplingParams(max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gemma4_checkpoint(tmp_path_factory.mktemp("gemma4mm") / "tiny", vision=True, audio=True,
                                  bidirectional_vision=True)


@pytest.fixture(scope="module")
def unified_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gemma4_checkpoint(tmp_path_factory.mktemp("gemma4-unified") / "tiny", unified=True, vision=True,
                                  audio=True, moe=False, ple_size=0, num_layers=4)


def _prompt(checkpoint: Path, media: list[tuple[str, bytes]], text: list[int],
            head: tuple[int, ...] = (2, 1000, 2000, 3000, 4000, 5000)) -> tuple[list[int], list[MediaItem]]:
    from shared.models.checkpoint import architecture_of

    found = read_multimodal(checkpoint, architecture_of(checkpoint)[0])
    assert found is not None
    mm, proc, _ = found
    ids, items = list(head), []
    for kind, data in media:
        if kind == "image":
            with Image.open(io.BytesIO(data)) as img:
                n, begin, token, end = proc.image_tokens(*img.size), mm.boi_token_id, mm.image_token_id, mm.eoi_token_id
        else:
            n = proc.audio_tokens(soundfile.info(io.BytesIO(data)).frames)
            begin, token, end = mm.boa_token_id, mm.audio_token_id, mm.eoa_token_id
        ids.append(begin)
        items.append(MediaItem(kind, len(ids), n, content_hash(data), data, "wav" if kind == "audio" else ""))
        ids += [token] * n + [end]
    return ids + text, items


def engine_settings(model: Path) -> dict[str, Any]:
    return dict(model=str(model), port=0, metrics_port=-1, kv_cache_bytes=16 << 20, max_model_len=512,
                kv_claim_wait_s=0.5, max_num_batched_tokens=32)


async def _generate(prefill: Any, decode: Any, kv: Any, prompt: list[int], items: list[MediaItem]
                    ) -> tuple[list[int], int]:
    request_id = uuid.uuid4().hex
    req = common_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                     params=sampling_params_to_proto(PARAMS), media=media_to_proto(items))
    handoff_id = f"h-{request_id}"
    first = await prefill_pb2_grpc.PrefillServiceStub(channel(prefill.address)).Prefill(prefill_pb2.PrefillRequest(
        request=req, handoff_id=handoff_id, kv_transfer_address=kv.address, handoff_capability=CAPABILITY))
    tokens = [first.first_token_id]
    async for msg in decode_pb2_grpc.DecodeServiceStub(channel(decode.address)).Generate(decode_pb2.DecodeRequest(
            request=req, handoff_id=handoff_id, kv_transfer_address=kv.address, first_token_id=first.first_token_id,
            handoff_capability=CAPABILITY)):
        tokens.extend(msg.token_ids)
    return tokens, first.num_cached_tokens


def test_media_disaggregated_equals_colocated_and_transformers(checkpoint: Path) -> None:
    text = [7000 + i for i in range(40)]
    wave = random_wave(0.4, seed=1)
    cases = [_prompt(checkpoint, [("image", image_bytes(40, 28, seed=3))], text),
             _prompt(checkpoint, [("image", image_bytes(40, 28, seed=4))], text),  # same text, another image
             _prompt(checkpoint, [("audio", wav_bytes(wave)), ("image", image_bytes(20, 52, seed=5))], text[:9])]
    colocated = LLMEngine(EngineConfig(model=str(checkpoint), max_model_len=512, kv_cache_bytes=16 << 20,
                                       max_num_batched_tokens=32))
    expected = [r.token_ids for r in colocated.generate([c[0] for c in cases], PARAMS, media=[c[1] for c in cases])]
    colocated.close()
    hf = hf_from_checkpoint(checkpoint)
    assert expected[0] == hf_mm_greedy(hf, cases[0][0], [random_image(40, 28, seed=3)], [], NUM_TOKENS)
    assert expected[2] == hf_mm_greedy(hf, cases[2][0], [random_image(20, 52, seed=5)], [wave], NUM_TOKENS)

    async def body() -> list[tuple[list[int], int]]:
        kv = await start_kv(KVTransferSettings(port=0, metrics_port=-1, max_claim_wait_s=1.0))
        first_prefill = await start_prefill(PrefillSettings(**engine_settings(checkpoint)))
        second_prefill = await start_prefill(PrefillSettings(**engine_settings(checkpoint)))
        decode = await start_decode(DecodeSettings(**engine_settings(checkpoint)))
        try:
            got = [await _generate(first_prefill, decode, kv, *cases[0]),
                   await _generate(second_prefill, decode, kv, *cases[1]),  # pool holds case 0's blocks
                   await _generate(second_prefill, decode, kv, *cases[0]),  # now a pool hit
                   await _generate(first_prefill, decode, kv, *cases[2])]
            await asyncio.sleep(0.2)
            engines = [s.host.aengine.engine for s in (first_prefill, second_prefill, decode)]
            assert all(e.num_free_kv_blocks == e.num_kv_blocks and not e.has_unfinished() for e in engines)
            assert kv.store.active_leases == 0
            # case 1's image only: case 0's lies wholly in blocks imported from the pool, and the towers run
            # only for the chunks that read an item
            assert second_prefill.host.aengine.engine.loaded.media_encoder.num_encoded == 1
            return got
        finally:
            for s in (decode, second_prefill, first_prefill, kv):
                await s.stop()

    got = asyncio.run(body())
    assert [g[0] for g in got] == [expected[0], expected[1], expected[0], expected[2]]
    block = 16  # EngineConfig's default block size: the image starts in the first block
    assert got[1][1] == 0  # another image: nothing before the image fills a whole block
    assert got[2][1] >= len(cases[0][0]) - 2 * block  # the first image again: read from kv_transfer's pool


def test_an_image_encoded_by_one_prefill_is_not_encoded_again_by_another(checkpoint: Path) -> None:
    """Prefill A encodes the image and offers its output to kv_transfer; prefill B, sent the same image in
    another prompt (no block of it in the pool), takes the output from kv_transfer and encodes nothing; a
    prefill with sharing off encodes it itself. All three answer as a colocated engine does."""
    image = image_bytes(40, 28, seed=7)
    text = [7100 + i for i in range(12)]
    cases = [_prompt(checkpoint, [("image", image)], text, head=(2, first, 2000)) for first in (1100, 1200, 1300)]
    colocated = LLMEngine(EngineConfig(model=str(checkpoint), max_model_len=512, kv_cache_bytes=16 << 20,
                                       max_num_batched_tokens=32))
    expected = [r.token_ids for r in colocated.generate([c[0] for c in cases], PARAMS, media=[c[1] for c in cases])]
    colocated.close()

    async def body() -> list[tuple[list[int], int]]:
        kv = await start_kv(KVTransferSettings(port=0, metrics_port=-1, max_claim_wait_s=1.0))
        sharing = [await start_prefill(PrefillSettings(**engine_settings(checkpoint))) for _ in range(2)]
        alone = await start_prefill(PrefillSettings(**engine_settings(checkpoint), share_encoder_outputs=False))
        decode = await start_decode(DecodeSettings(**engine_settings(checkpoint)))
        encoders = [s.host.aengine.engine.loaded.media_encoder for s in (*sharing, alone)]
        try:
            got = [await _generate(sharing[0], decode, kv, *cases[0])]
            for _ in range(100):  # the offer is sent after the reply
                if len(kv.encoder_cache):
                    break
                await asyncio.sleep(0.05)
            assert len(kv.encoder_cache) == 1 and kv.encoder_cache.nbytes > 0
            got.append(await _generate(sharing[1], decode, kv, *cases[1]))
            got.append(await _generate(alone, decode, kv, *cases[2]))
            assert [e.num_encoded for e in encoders] == [1, 0, 1]
            assert kv.encoder_cache.num_hits == 1
            return got
        finally:
            for s in (decode, alone, *sharing, kv):
                await s.stop()

    got = asyncio.run(body())
    assert [g[0] for g in got] == expected
    assert all(g[1] == 0 for g in got)  # no block came from the pool: the encoder output did


@pytest.mark.parametrize("layout", ["gemma4", "gemma4_unified"])
def test_an_encoder_service_encodes_for_the_prefill(layout: str, request: pytest.FixtureRequest) -> None:
    """encode -> prefill -> decode, for Gemma 4's towers and gemma4_unified's embedders: the encoder service
    puts the image's and the clip's outputs in kv_transfer (two concurrent calls batched into at most two
    tower passes), the prefill finds them and encodes nothing, and the answer is the colocated one. Bad media
    is INVALID_ARGUMENT; GetLoad answers."""
    checkpoint: Path = request.getfixturevalue("checkpoint" if layout == "gemma4" else "unified_checkpoint")
    wave = random_wave(0.4, seed=8)
    case = _prompt(checkpoint, [("image", image_bytes(40, 28, seed=9)), ("audio", wav_bytes(wave))],
                   [7200 + i for i in range(6)])
    other = _prompt(checkpoint, [("image", image_bytes(20, 52, seed=10))], [7300])
    colocated = LLMEngine(EngineConfig(model=str(checkpoint), max_model_len=512, kv_cache_bytes=16 << 20,
                                       max_num_batched_tokens=32))
    expected = colocated.generate([case[0]], PARAMS, media=[case[1]])[0].token_ids
    colocated.close()

    async def body() -> list[int]:
        kv = await start_kv(KVTransferSettings(port=0, metrics_port=-1, max_claim_wait_s=1.0))
        encoder = await start_encoder(EncoderSettings(**engine_settings(checkpoint)))
        prefill = await start_prefill(PrefillSettings(**engine_settings(checkpoint)))
        decode = await start_decode(DecodeSettings(**engine_settings(checkpoint)))
        try:
            stub = encoder_pb2_grpc.EncoderServiceStub(channel(encoder.address))
            replies = await asyncio.gather(*(stub.Encode(encoder_pb2.EncodeRequest(
                request_id=f"enc-{i}", media=media_to_proto(items), kv_transfer_address=kv.address))
                for i, (_, items) in enumerate((case, other))))
            assert [(r.num_encoded, r.num_found, r.num_stored) for r in replies] == [(2, 0, 2), (1, 0, 1)]
            passes = encoder.metrics.registry.get_sample_value("baton_encoder_batch_items_count")
            assert encoder.metrics.registry.get_sample_value("baton_encoder_batch_items_sum") == 3
            assert passes is not None and 1 <= passes <= 2  # the three items in one or two tower passes
            again = await stub.Encode(encoder_pb2.EncodeRequest(request_id="enc-again", media=media_to_proto(
                case[1]), kv_transfer_address=kv.address))
            assert (again.num_encoded, again.num_found) == (0, 2)
            tokens, _ = await _generate(prefill, decode, kv, *case)
            assert prefill.host.aengine.engine.loaded.media_encoder.num_encoded == 0
            bad = MediaItem("image", 7, 4, content_hash(b"not an image"), b"not an image")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Encode(encoder_pb2.EncodeRequest(request_id="bad", media=media_to_proto([bad]),
                                                            kv_transfer_address=kv.address))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (await stub.GetLoad(encoder_pb2.EncoderLoadRequest())).num_running == 0
            return tokens
        finally:
            for s in (decode, prefill, encoder, kv):
                await s.stop()

    assert asyncio.run(body()) == expected
