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


_ALIGN = 16  # bytes: each part's slice starts where any dtype's view (and a vectorized kernel load) may


def pack_host(tensors: Sequence[torch.Tensor], pin: bool = False) -> tuple[torch.Tensor, list[int]]:
    """The tensors' bytes in one uint8 buffer (pinned if asked), each at an offset aligned to 16 bytes."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    buffer = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=pin)
    for t, at in zip(tensors, offsets, strict=True):
        _part(buffer, t, at).copy_(t)
    return buffer, offsets


def _part(buffer: torch.Tensor, like: torch.Tensor, at: int) -> torch.Tensor:
    """The slice of `buffer` at byte `at` seen as a tensor of `like`'s dtype and shape."""
    return buffer[at : at + like.numel() * like.element_size()].view(like.dtype).view(like.shape)


def unpack(buffer: torch.Tensor, like: Sequence[torch.Tensor], offsets: Sequence[int]) -> list[torch.Tensor]:
    """Views of a `pack_host` buffer (or a copy of it on another device) as the tensors it was packed from."""
    return [_part(buffer, t, at) for t, at in zip(like, offsets, strict=True)]


def pack_to_device(parts: Sequence[tuple[Sequence[Any] | torch.Tensor, torch.dtype]],
                   device: torch.device | str) -> list[torch.Tensor]:
    """Several host values (each a list or a host tensor, with its dtype) on `device`.

    On CUDA in one enqueued copy: a step's inputs are ten small tensors, and each copy is a driver call that
    costs the host more than the bytes (~20 us apiece under a sandboxed kernel). Each comes back as a view of
    its slice of the one device buffer. Elsewhere, plain tensors.
    """
    tensors = [v.to(dtype) if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=dtype) for v, dtype in parts]
    device = torch.device(device)
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    buffer, offsets = pack_host(tensors, pin=True)
    return unpack(buffer.to(device, non_blocking=True), tensors, offsets)


def to_host_async(*tensors: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.cuda.Event]:
    """CUDA tensors copied into new pinned host tensors, queued on the current stream.

    Read the host tensors after `event.synchronize()`: it waits for the kernels queued so far,
    not for any queued after this call.
    """
    host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors)
    event = torch.cuda.Event()
    event.record()
    return host, event
