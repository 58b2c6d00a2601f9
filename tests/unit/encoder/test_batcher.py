"""The encoder service's batcher: items queued while a tower pass runs go into the next pass together."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest
import torch

from services.encoder.batcher import EncodeBatcher
from shared.multimodal.items import PreparedMedia


class _Towers:
    """Stands in for MediaEncoder.encode_batch: records each pass, can hold the first one or fail."""

    def __init__(self, fail_on: int = -1) -> None:
        self.passes: list[list[int]] = []
        self.release_first = threading.Event()
        self.fail_on = fail_on

    def __call__(self, items: Sequence[PreparedMedia]) -> list[torch.Tensor]:
        self.passes.append([int(p.item) for p in items])  # type: ignore[call-overload]
        if len(self.passes) == 1:
            self.release_first.wait(5)
        if len(self.passes) - 1 == self.fail_on:
            raise RuntimeError("tower failed")
        return [torch.full((1,), float(p.item)) for p in items]  # type: ignore[arg-type]


def _item(n: int) -> PreparedMedia:
    return PreparedMedia(n, None)  # type: ignore[arg-type]


def test_calls_arriving_during_a_pass_share_the_next_one() -> None:
    async def main() -> None:
        towers = _Towers()
        batcher = EncodeBatcher(towers, max_items=8)
        batcher.start()
        first = asyncio.create_task(batcher.encode([_item(1)]))
        while not towers.passes:
            await asyncio.sleep(0.01)
        later = [asyncio.create_task(batcher.encode([_item(n), _item(n + 1)])) for n in (10, 20)]
        await asyncio.sleep(0.05)
        assert batcher.num_queued == 5
        towers.release_first.set()
        assert [t.item() for t in await first] == [1]
        assert [[t.item() for t in await f] for f in later] == [[10, 11], [20, 21]]
        assert towers.passes == [[1], [10, 11, 20, 21]] and batcher.num_queued == 0
        await batcher.stop()

    asyncio.run(main())


def test_a_failed_pass_fails_its_calls_and_the_next_pass_runs() -> None:
    async def main() -> None:
        towers = _Towers(fail_on=0)
        towers.release_first.set()
        batcher = EncodeBatcher(towers, max_items=2)
        batcher.start()
        with pytest.raises(RuntimeError, match="tower failed"):
            await batcher.encode([_item(1), _item(2)])
        assert [t.item() for t in await batcher.encode([_item(3), _item(4), _item(5)])] == [3, 4, 5]
        assert towers.passes == [[1, 2], [3, 4], [5]]  # at most max_items a pass
        await batcher.stop()

    asyncio.run(main())
