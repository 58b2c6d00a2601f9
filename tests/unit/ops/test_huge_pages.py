"""shared/ops/huge_pages.py: packs copied into one buffer (of huge pages) read back the same, and serve the same."""

from __future__ import annotations

import itertools

import pytest
import torch

from shared.ops import huge_pages
from shared.ops.cpu_kernels import cpu_kernels_available
from shared.ops.linear import LinearWeight
from shared.ops.quant import int8_per_channel


def _anon_huge_bytes(tensor: torch.Tensor) -> int:
    """Bytes of `tensor`'s storage that sit on transparent huge pages now (/proc/self/smaps)."""
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and hi > start
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(300, 7, generator=g), torch.randint(-128, 127, (4096 + 5,), dtype=torch.int8, generator=g),
            torch.randn(3, 5, generator=g).to(torch.bfloat16), torch.randn(1024, 1024, generator=g)]


@pytest.mark.parametrize("huge", [True, False])
def test_copies_in_one_buffer_keep_dtype_shape_and_values_on_pages_of_their_own(huge: bool) -> None:
    tensors = _tensors()
    copies = huge_pages.into_one_buffer(tensors, huge=huge)
    for original, copy in zip(tensors, copies, strict=True):
        assert copy.dtype == original.dtype and copy.shape == original.shape and copy.is_contiguous()
        assert torch.equal(copy, original) and copy.data_ptr() != original.data_ptr()
        assert copy.data_ptr() % 64 == 0  # the kernels' panels are 64-byte aligned
    assert len({c.untyped_storage().data_ptr() for c in copies}) == 1  # one buffer
    pages = [(c.data_ptr() // 4096, (c.data_ptr() + c.nbytes - 1) // 4096) for c in copies]
    assert all(a[1] < b[0] for a, b in itertools.pairwise(pages))  # no page shared by two packs
    assert len({c.data_ptr() % 4096 for c in copies}) == len(copies)  # each starts at another place in its page


def test_the_buffer_is_on_huge_pages_where_the_kernel_gives_them() -> None:
    if huge_pages.thp_mode() in ("", "never"):
        pytest.skip(f"transparent huge pages are {huge_pages.thp_mode() or 'not in this kernel'}")
    copies = huge_pages.into_one_buffer([torch.ones(3 << 20, dtype=torch.int8)])  # 3 MiB: a whole 2 MiB page
    assert _anon_huge_bytes(copies[0]) >= 2 << 20


@pytest.mark.skipif(not cpu_kernels_available(), reason="the C++ CPU kernels did not build")
def test_placed_packs_give_the_same_bits_and_can_move_back() -> None:
    g = torch.Generator().manual_seed(1)
    w8 = LinearWeight.quantized(int8_per_channel(torch.randn(96, 64, generator=g)))
    fp32 = LinearWeight(torch.randn(48, 64, generator=g))  # oneDNN's weight stays; its GEMV copy moves
    x = torch.randn(3, 64, generator=g)
    before = [w8(x), fp32(x)]
    slots = huge_pages.packed_slots([w8, fp32])
    assert (w8, "weight") in slots and (fp32, "weight") not in slots
    assert huge_pages.place(slots, huge=True) == sum(getattr(o, n).nbytes for o, n in slots)
    assert all(torch.equal(a, b) for a, b in zip(before, [w8(x), fp32(x)], strict=True))
    huge_pages.place(slots, huge=False)
    assert all(torch.equal(a, b) for a, b in zip(before, [w8(x), fp32(x)], strict=True))
