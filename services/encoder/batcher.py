"""Continuous batching for the towers: every item queued while a pass runs goes into the next pass.

    Encode calls ──put(prepared)──► queue ──worker: take all queued (<= max_items)──► encode_batch (a thread)
                 ◄── each call's future ─────────────────────────────────────────────┘

One pass at a time (the towers are not reentrant, and on the CPU a second pass would only compete for the
same cores); a failed pass fails the calls it held, not the worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import torch

from shared.multimodal.items import PreparedMedia

logger = logging.getLogger(__name__)

EncodeBatch = Callable[[Sequence[PreparedMedia]], list[torch.Tensor]]
_Waiting = tuple[PreparedMedia, "asyncio.Future[torch.Tensor]"]


class EncodeBatcher:
    def __init__(self, encode_batch: EncodeBatch, max_items: int,
                 on_batch: Callable[[int, float], None] | None = None) -> None:
        self._encode_batch = encode_batch
        self._max_items = max_items
        self._on_batch = on_batch  # (items, seconds) of each pass, for metrics
        self._queue: asyncio.Queue[_Waiting] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None
        self.num_queued = 0  # items waiting or in the running pass

    def start(self) -> None:
        self._worker = asyncio.create_task(self._run(), name="encoder-batcher")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        while not self._queue.empty():
            _, future = self._queue.get_nowait()
            future.cancel()

    async def encode(self, items: Sequence[PreparedMedia]) -> list[torch.Tensor]:
        """Each item's output, from whichever passes take them."""
        loop = asyncio.get_running_loop()
        futures = []
        for item in items:
            future: asyncio.Future[torch.Tensor] = loop.create_future()
            self._queue.put_nowait((item, future))
            self.num_queued += 1
            futures.append(future)
        return list(await asyncio.gather(*futures))

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self._max_items and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            t0 = time.perf_counter()
            try:
                outputs = await asyncio.to_thread(self._encode_batch, [item for item, _ in batch])
            except Exception as e:  # the calls waiting on this pass fail with it; later passes go on
                logger.warning("an encoder pass of %d items failed: %s", len(batch), e)
                for _, future in batch:
                    if not future.done():
                        future.set_exception(e)
            else:
                for (_, future), output in zip(batch, outputs, strict=True):
                    if not future.done():
                        future.set_result(output)
                if self._on_batch is not None:
                    self._on_batch(len(batch), time.perf_counter() - t0)
            finally:
                self.num_queued -= len(batch)
