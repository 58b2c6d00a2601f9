"""A CPU model's packed weights in one buffer of 2 MiB pages.

A decode step streams every projection's weights from DRAM once (SmolLM2 in int8: 106 MB a step). On 4 KiB
pages that is one TLB miss every 64 cache lines, and the hardware prefetchers stop at every page's end; each
projection is its own allocation of 0.3-1.8 MB, under the 2 MiB from which torch's allocator would ask for
huge pages at all (THP_MEM_ALLOC_ENABLE). Here the packs are copied into one buffer that asked for huge
pages before its first touch (shared/transport/memory.py's host_buffer, which the KV cache comes from too),
so its pages are huge from the start where transparent huge pages are "madvise" or "always". The kernels
read the same bytes: the same bits.

Measured on Zen 5, two threads, SmolLM2, whole decode steps against each pack in its own allocation
(bench/huge_pages.py, medians of 9 interleaved rounds): int8 with fp8 KV 1.05x at batch 1, 1.02x at 8, 1.03x
at 32; bf16 1.10x, 1.15x and 1.08x (huge_pages-20261129-125730, -125749). The same buffer on 4 KiB pages did
not gain (0.93-1.01x on the projections alone): the gain is the pages, not the packing.

`BATON_HUGE_PAGES=0` leaves each weight where it is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from shared.transport.memory import host_buffer

logger = logging.getLogger(__name__)

_PAGE = 4096
# Each pack starts at one of _COLOURS places _COLOUR_BYTES apart in its first page, not at the page's start:
# packs that all began page-aligned, on pages physically contiguous, left bf16 decode steps of batch 32 at
# 27.6-31.4 ms against 24.4-25.4 with each pack in its own allocation (Zen 5, two threads); staggered, 23.6
# (and batch 8 10.5 against 12.9). Three lines a colour keeps every pack 64-byte aligned, as the kernels'
# panels are.
_COLOURS, _COLOUR_BYTES = 16, 192


def enabled() -> bool:
    return os.environ.get("BATON_HUGE_PAGES", "1") != "0"


def thp_mode() -> str:
    """The kernel's transparent huge page setting ("always", "madvise", "never"), or "" where it has none."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def movable(tensor: torch.Tensor | None) -> bool:
    """A plain dense CPU tensor that a copy can stand in for (not oneDNN's opaque ones)."""
    return (tensor is not None and tensor.device.type == "cpu" and tensor.layout == torch.strided
            and tensor.is_contiguous() and not tensor.is_mkldnn and tensor.numel() > 0)


def _colour(i: int) -> int:
    """Where in its page the i-th pack starts: 16 colours in an order that puts neighbours far apart."""
    return (i * 7 % _COLOURS) * _COLOUR_BYTES


def into_one_buffer(tensors: Sequence[torch.Tensor], huge: bool = True) -> list[torch.Tensor]:
    """Copies of `tensors` (same dtypes, shapes and values) side by side in one buffer, each on pages of its
    own and starting at its colour within its first; with `huge`, a buffer of 2 MiB pages (host_buffer). The
    originals are left for the caller to drop."""
    sizes = [(_colour(i) + t.nbytes + _PAGE - 1) // _PAGE * _PAGE for i, t in enumerate(tensors)]
    total = sum(sizes)
    if huge:  # advised before the copies below first touch it (shared/transport/memory.py)
        buf, offset = host_buffer(total, prefault=False), 0
    else:
        buf = torch.empty(total + _PAGE, dtype=torch.uint8)
        offset = -buf.data_ptr() % _PAGE
    out = []
    for i, (tensor, size) in enumerate(zip(tensors, sizes, strict=True)):
        start = offset + _colour(i)
        view = buf[start:start + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        out.append(view)
        offset += size
    return out


# LinearWeight backends whose `weight` is a pack of their own (never another tensor, such as a tied embedding)
_PACKED_BACKENDS = ("gemv_bf16", "qgemv", "w8a8")


def packed_slots(linears: Iterable[object]) -> list[tuple[object, str]]:
    """(LinearWeight, attribute) of every pack the CPU kernels stream: the bf16, quantized and W8A8 packs and
    the fp32 GEMV copies (oneDNN's weight stays: it may be a tied embedding's tensor)."""
    slots = []
    for lin in linears:
        names = ["weight"] if getattr(lin, "backend", None) in _PACKED_BACKENDS else []
        names += ["gemv"] if getattr(lin, "gemv", None) is not None else []
        slots += [(lin, name) for name in names if movable(getattr(lin, name))]
    return slots


def place(slots: Sequence[tuple[object, str]], huge: bool) -> int:
    """Put the tensors at `slots` in one buffer of 2 MiB pages (`huge`), or each in an allocation of its own
    (as loading leaves them: bench/huge_pages.py compares the two); returns the bytes placed. Anything holding
    the old tensors (a C++ layer loop) must be built again."""
    tensors = [getattr(owner, name) for owner, name in slots]
    copies = into_one_buffer(tensors) if huge else [t.clone() for t in tensors]
    for (owner, name), copy in zip(slots, copies, strict=True):
        setattr(owner, name, copy)
    return sum(c.nbytes for c in copies)


def weights_on_huge_pages(linears: Iterable[object]) -> int:
    """The model loader's call: every pack of `linears` (packed_slots) into one buffer of 2 MiB pages, unless
    BATON_HUGE_PAGES=0; returns the bytes moved."""
    slots = packed_slots(linears)
    if not slots or not enabled():
        return 0
    nbytes = place(slots, huge=True)
    logger.info("huge pages: %d weight packs (%.0f MB) in one buffer of 2 MiB pages (transparent huge pages: %s)",
                len(slots), nbytes / 1e6, thp_mode() or "not in this kernel")
    return nbytes
