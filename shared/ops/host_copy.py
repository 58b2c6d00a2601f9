"""Host values onto the device, and results back, without making the host wait for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory, and PyTorch
waits for a blocking copy to finish, which waits for every kernel queued before
it: in the zero-bubble loop that is the whole step in flight, so planning step
N+1 would stall until step N ended. Staging through pinned memory and copying
with `non_blocking=True` only enqueues the copy (the caching host allocator
keeps the pinned buffer alive until the copy has run). The way back is the
same: a copy into pinned memory queued behind the kernels that made the values,
and an event to wait on for those kernels alone. On the CPU these are plain
tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def to_device(values: Sequence[Any], dtype: torch.dtype | None = None,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)`, enqueued rather than waited for on CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def tensor_to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor moved to `device`, enqueued rather than waited for on CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def to_host_async(*tensors: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.cuda.Event]:
    """CUDA tensors copied into new pinned host tensors, queued on the current stream.

    Read the host tensors after `event.synchronize()`: it waits for the kernels queued so far,
    not for any queued after this call.
    """
    host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors)
    event = torch.cuda.Event()
    event.record()
    return host, event
