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

import numpy as np
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

# A step's host values are a few short lists: numpy makes each an array in a microsecond or two, where a torch
# tensor per list (and a copy of each into the buffer) cost the zero-bubble loop's host ~10 us apiece.
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.uint8: np.uint8,
          torch.bool: np.bool_}
_TORCH = {np.dtype(v): k for k, v in _NUMPY.items()}

HostValue = Sequence[Any] | np.ndarray | torch.Tensor


def as_array(values: HostValue, dtype: torch.dtype) -> np.ndarray:
    """A host value (a list, a numpy array or a host tensor) as a contiguous numpy array of `dtype`."""
    if isinstance(values, torch.Tensor):
        values = values.numpy()
    return np.ascontiguousarray(values, dtype=_NUMPY[dtype])


def pack_host(arrays: Sequence[np.ndarray | torch.Tensor], pin: bool = False) -> tuple[torch.Tensor, list[int]]:
    """The arrays' bytes in one uint8 buffer (pinned if asked), each at an offset aligned to 16 bytes."""
    arrays = [a.numpy() if isinstance(a, torch.Tensor) else a for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    buffer = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=pin)
    view = buffer.numpy()
    for a, at in zip(arrays, offsets, strict=True):
        view[at : at + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return buffer, offsets


def unpack(buffer: torch.Tensor, like: Sequence[np.ndarray | torch.Tensor], offsets: Sequence[int]) -> list[torch.Tensor]:
    """Views of a `pack_host` buffer (or a copy of it on another device) as the arrays it was packed from."""
    parts = []
    for a, at in zip(like, offsets, strict=True):
        dtype = a.dtype if isinstance(a, torch.Tensor) else _TORCH[a.dtype]
        flat = buffer[at : at + a.nbytes].view(dtype)
        parts.append(flat if a.ndim == 1 else flat.view(tuple(a.shape)))
    return parts


def pack_to_device(parts: Sequence[tuple[HostValue, torch.dtype]], device: torch.device | str) -> list[torch.Tensor]:
    """Several host values (each a list, a numpy array or a host tensor, with its dtype) on `device`.

    On CUDA in one enqueued copy: a step's inputs are ten small tensors, and each copy is a driver call that
    costs the host more than the bytes (~20 us apiece under a sandboxed kernel). Each comes back as a view of
    its slice of the one device buffer. Elsewhere, tensors over the numpy arrays.
    """
    arrays = [as_array(v, dtype) for v, dtype in parts]
    device = torch.device(device)
    if device.type != "cuda":
        return [torch.from_numpy(a).to(device) for a in arrays]
    buffer, offsets = pack_host(arrays, pin=True)
    return unpack(buffer.to(device, non_blocking=True), arrays, offsets)


def to_host_async(*tensors: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.cuda.Event]:
    """CUDA tensors copied into new pinned host tensors, queued on the current stream.

    Read the host tensors after `event.synchronize()`: it waits for the kernels queued so far,
    not for any queued after this call.
    """
    host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors)
    event = torch.cuda.Event()
    event.record()
    return host, event
