"""Region and descriptor bookkeeping: what every backend checks before a byte moves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.kv.layout import KVLayout
from shared.transport import Descriptor, InvalidDescriptorError, MemoryRegion, MemType
from shared.transport.memory import HUGE_PAGE_NBYTES, host_buffer
from shared.transport.regions import RegionTable, describe_memory, host_view, validate_transfer

LAYOUT = KVLayout(num_layers=3, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)


def test_describe_memory_of_tensors_and_buffers() -> None:
    kv = LAYOUT.allocate()
    region = describe_memory(kv)
    assert region == MemoryRegion(kv.data_ptr(), LAYOUT.total_nbytes, MemType.DRAM, 0)
    buf = bytearray(100)
    assert describe_memory(buf).nbytes == 100
    arr = np.zeros(16, dtype=np.float32)
    assert describe_memory(arr) == MemoryRegion(arr.ctypes.data, 64)


@pytest.mark.parametrize("memory", [torch.zeros(4, 4).t(), b"read-only", torch.zeros(0), object()],
                         ids=["non-contiguous", "read-only", "empty", "not-a-buffer"])
def test_describe_memory_rejects(memory: object) -> None:
    with pytest.raises(InvalidDescriptorError):
        describe_memory(memory)


def test_region_descriptors_follow_the_kv_layout() -> None:
    region = MemoryRegion(1 << 20, LAYOUT.total_nbytes)
    descs = region.descriptors(LAYOUT.block_ranges([1, 6], layers=[0, 2]))
    assert descs == [
        Descriptor((1 << 20) + r.offset, LAYOUT.block_nbytes) for r in LAYOUT.block_ranges([1, 6], [0, 2])
    ]
    assert all(region.contains(d) for d in descs)
    with pytest.raises(InvalidDescriptorError):
        region.descriptor(LAYOUT.total_nbytes - 8, 16)
    with pytest.raises(InvalidDescriptorError):
        region.descriptor(0, 0)


def test_table_finds_the_region_holding_a_descriptor() -> None:
    a, b = MemoryRegion(1000, 100), MemoryRegion(5000, 50)
    gpu = MemoryRegion(1000, 100, MemType.VRAM, device_id=1)
    table = RegionTable([b, a, gpu])
    assert table.find(Descriptor(1000, 100)) == a
    assert table.find(Descriptor(5010, 40)) == b
    assert table.find(Descriptor(1050, 10, device_id=1)) == gpu
    for bad in (Descriptor(1090, 20), Descriptor(1100, 1), Descriptor(999, 2), Descriptor(2000, 1),
                Descriptor(1000, 0), Descriptor(5000, 10, device_id=3)):
        with pytest.raises(InvalidDescriptorError):
            table.find(bad)


def test_table_rejects_overlaps_and_unknown_removals() -> None:
    table = RegionTable([MemoryRegion(1000, 100)])
    with pytest.raises(InvalidDescriptorError, match="overlaps"):
        table.add(MemoryRegion(1050, 100))
    with pytest.raises(InvalidDescriptorError, match="overlaps"):
        table.add(MemoryRegion(900, 101))
    table.add(MemoryRegion(1100, 10))  # adjacent is fine
    with pytest.raises(InvalidDescriptorError, match="not registered"):
        table.remove(MemoryRegion(2000, 10))
    table.remove(MemoryRegion(1000, 100))
    assert table.regions == [MemoryRegion(1100, 10)]


def test_validate_transfer() -> None:
    local, remote = RegionTable([MemoryRegion(0x1000, 4096)]), RegionTable([MemoryRegion(0x9000, 4096)])
    lo = [Descriptor(0x1000, 512), Descriptor(0x1800, 256)]
    re = [Descriptor(0x9000, 512), Descriptor(0x9f00, 256)]
    assert validate_transfer(local, lo, remote, re) == ([MemoryRegion(0x1000, 4096)] * 2,
                                                        [MemoryRegion(0x9000, 4096)] * 2)
    cases = {
        "at least one": ([], []),
        "1 local descriptors vs 2": (lo[:1], re),
        "512 local bytes vs 256": (lo[:1], re[1:]),
        "local": ([Descriptor(0x1f00, 512)], re[:1]),
        "remote": (lo[1:], [Descriptor(0x9f80, 256)]),
    }
    for message, (l_descs, r_descs) in cases.items():
        with pytest.raises(InvalidDescriptorError, match=message):
            validate_transfer(local, l_descs, remote, r_descs)


def test_host_view_reads_and_writes_in_place() -> None:
    data = torch.arange(16, dtype=torch.uint8)
    view = host_view(Descriptor(data.data_ptr() + 4, 4))
    assert bytes(view) == bytes([4, 5, 6, 7])
    view[0] = 99
    assert int(data[4]) == 99


def test_host_buffer_is_zeroed_aligned_and_shaped() -> None:
    kv = host_buffer(LAYOUT.shape, LAYOUT.dtype)
    assert kv.shape == LAYOUT.shape and kv.dtype == LAYOUT.dtype and kv.is_contiguous()
    assert kv.data_ptr() % HUGE_PAGE_NBYTES == 0
    assert not kv.any()
    kv.fill_(1.5)
    assert float(kv.sum()) == 1.5 * kv.numel()
    with pytest.raises(ValueError):
        host_buffer(0)
