"""Media items on requests (shared/multimodal/items.py): prefix-hash keys, chunk cuts, placement checks; and the
scheduler never splitting an image whose tokens attend to each other (no model)."""

from __future__ import annotations

from shared.engine.block_pool import BlockPool, hash_block, hash_prefix_blocks
from shared.engine.kv_manager import KVCacheManager
from shared.engine.request import Request, SamplingParams
from shared.engine.scheduler import Scheduler, SchedulerConfig
from shared.multimodal.items import (
    AUDIO,
    IMAGE,
    MediaInput,
    MediaItem,
    block_media_key,
    check_placement,
    fit_chunk_end,
)
from shared.multimodal.media import content_hash

IMG, AUD = 900, 901


def item(kind: str, offset: int, n: int, data: bytes = b"x") -> MediaItem:
    return MediaItem(kind, offset, n, content_hash(data), data, "wav" if kind == AUDIO else "")


def test_block_keys_name_the_items_a_block_touches() -> None:
    media = [MediaInput(item(IMAGE, 5, 6, b"a")), MediaInput(item(AUDIO, 14, 2, b"b"))]
    assert [block_media_key(media, i, 4) for i in range(5)] == [
        b"", content_hash(b"a"), content_hash(b"a"), content_hash(b"b"), b""]
    prompt = list(range(20))
    plain = hash_prefix_blocks(prompt, 4, b"salt")
    with_media = hash_prefix_blocks(prompt, 4, b"salt", [m.item for m in media])
    other = hash_prefix_blocks(prompt, 4, b"salt", [item(IMAGE, 5, 6, b"c"), item(AUDIO, 14, 2, b"b")])
    assert plain[0] == with_media[0] == other[0]  # before the image: shared
    assert all(a != b for a, b in zip(with_media[1:], other[1:], strict=True))  # from the image on: apart
    assert hash_block(None, prompt[:4], b"salt") == plain[0]  # text-only hashes are what they were


def test_chunk_cuts_keep_images_whole() -> None:
    media = [MediaInput(item(IMAGE, 10, 8)), MediaInput(item(AUDIO, 20, 6))]
    assert fit_chunk_end(media, 0, 14) == 10  # cut before the image
    assert fit_chunk_end(media, 10, 14) == 18  # a chunk starting at the image takes it whole
    assert fit_chunk_end(media, 12, 14) == 18  # or inside it (a prefix hit ended there)
    assert fit_chunk_end(media, 0, 23) == 23  # audio may be split: it has no two-way attention


def test_placement_is_checked() -> None:
    prompt = [1, 2, IMG, IMG, IMG, 3, AUD, AUD, 4]
    ids = {IMAGE: IMG, AUDIO: AUD}
    assert check_placement([item(IMAGE, 2, 3), item(AUDIO, 6, 2)], prompt, ids) is None
    assert "placeholder" in (check_placement([item(IMAGE, 1, 3)], prompt, ids) or "")
    assert "overlaps" in (check_placement([item(IMAGE, 2, 3), item(IMAGE, 3, 2)], prompt, ids) or "")
    assert "placeholder tokens" in (check_placement([item(IMAGE, 2, 3)], prompt, ids) or "")  # audio unaccounted


def test_scheduler_never_splits_an_image_seen_both_ways() -> None:
    pool = BlockPool(64)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=256),
                          KVCacheManager(pool, 4))
    prompt = [5] * 6 + [IMG] * 12 + [6] * 5
    request = Request("r", prompt, SamplingParams(max_tokens=2), media=[MediaInput(item(IMAGE, 6, 12))],
                      bidirectional_images=True)
    scheduler.add_request(request)
    spans = []
    while request.num_computed_tokens < len(prompt):
        plan = scheduler.schedule()
        (chunk,) = plan.chunks
        spans.append((chunk.start_pos, chunk.start_pos + chunk.num_tokens))
        request.num_computed_tokens = chunk.start_pos + chunk.num_tokens  # as if the step ran
    assert spans == [(0, 6), (6, 18), (18, 23)]  # the image's 12 tokens in one chunk past the budget of 8
