"""Registered-memory bookkeeping shared by every backend.

Each agent keeps its own regions (what it registered, with a reference to the
object so that the memory outlives the registration) and, per remote agent,
the regions that agent advertised in its metadata. A transfer is checked
against both before any backend sees it, so every backend rejects the same
descriptors with the same error.
"""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from shared.transport.base import Descriptor, InvalidDescriptorError, MemoryRegion, MemType


def describe_memory(memory: Any) -> MemoryRegion:
    """The region a contiguous tensor or a writable buffer occupies."""
    if isinstance(memory, torch.Tensor):
        if not memory.is_contiguous():
            raise InvalidDescriptorError("only contiguous tensors can be registered")
        nbytes = memory.numel() * memory.element_size()
        if memory.is_cuda:
            return _checked(MemoryRegion(memory.data_ptr(), nbytes, MemType.VRAM, memory.get_device()))
        if memory.device.type != "cpu":
            raise InvalidDescriptorError(f"cannot register memory on device {memory.device}")
        return _checked(MemoryRegion(memory.data_ptr(), nbytes))
    try:
        view = memoryview(memory).cast("B")
    except TypeError as e:
        raise InvalidDescriptorError(f"cannot register {type(memory).__name__}: {e}") from e
    if view.readonly:
        raise InvalidDescriptorError("cannot register a read-only buffer")
    addr = ctypes.addressof(ctypes.c_char.from_buffer(view)) if view.nbytes else 0
    return _checked(MemoryRegion(addr, view.nbytes))


def _checked(region: MemoryRegion) -> MemoryRegion:
    if region.nbytes <= 0:
        raise InvalidDescriptorError("cannot register an empty region")
    return region


def host_view(desc: Descriptor) -> memoryview:
    """A writable memoryview over host memory inside a registered region (no copy)."""
    return memoryview((ctypes.c_char * desc.nbytes).from_address(desc.addr)).cast("B")


class RegionTable:
    """Non-overlapping regions sorted by address; finds the one holding a descriptor."""

    def __init__(self, regions: Sequence[MemoryRegion] = ()) -> None:
        self._regions: list[MemoryRegion] = []
        self._owners: dict[MemoryRegion, Any] = {}
        for region in regions:
            self.add(region)

    @property
    def regions(self) -> list[MemoryRegion]:
        return list(self._regions)

    def __len__(self) -> int:
        return len(self._regions)

    def add(self, region: MemoryRegion, owner: Any = None) -> None:
        i = bisect.bisect_left(self._regions, region.addr, key=lambda r: r.addr)
        for neighbour in self._regions[max(0, i - 1):i + 1]:
            if (neighbour.device_id == region.device_id and neighbour.mem_type is region.mem_type
                    and neighbour.addr < region.end and region.addr < neighbour.end):
                raise InvalidDescriptorError(f"{region} overlaps registered {neighbour}")
        self._regions.insert(i, region)
        self._owners[region] = owner

    def remove(self, region: MemoryRegion) -> None:
        if region not in self._owners:
            raise InvalidDescriptorError(f"{region} is not registered")
        self._regions.remove(region)
        del self._owners[region]

    def find(self, desc: Descriptor) -> MemoryRegion:
        """The region holding all of `desc`; raises `InvalidDescriptorError` if none does."""
        if desc.nbytes <= 0:
            raise InvalidDescriptorError(f"{desc} is empty")
        i = bisect.bisect_right(self._regions, desc.addr, key=lambda r: r.addr)
        # Regions of different devices may share addresses: look back over every candidate.
        for region in reversed(self._regions[:i]):
            if region.contains(desc):
                return region
            if region.end <= desc.addr and region.device_id == desc.device_id:
                break
        raise InvalidDescriptorError(f"{desc} is outside every registered region")


def validate_transfer(
    local: RegionTable, local_descs: Sequence[Descriptor], remote: RegionTable,
    remote_descs: Sequence[Descriptor],
) -> tuple[list[MemoryRegion], list[MemoryRegion]]:
    """Check pairing and bounds; returns each descriptor's region (local, remote)."""
    if not local_descs:
        raise InvalidDescriptorError("a transfer needs at least one descriptor")
    if len(local_descs) != len(remote_descs):
        raise InvalidDescriptorError(f"{len(local_descs)} local descriptors vs {len(remote_descs)} remote")
    for i, (lo, re) in enumerate(zip(local_descs, remote_descs, strict=True)):
        if lo.nbytes != re.nbytes:
            raise InvalidDescriptorError(f"descriptor {i}: {lo.nbytes} local bytes vs {re.nbytes} remote")
    try:
        local_regions = [local.find(d) for d in local_descs]
    except InvalidDescriptorError as e:
        raise InvalidDescriptorError(f"local: {e.message}") from None
    try:
        remote_regions = [remote.find(d) for d in remote_descs]
    except InvalidDescriptorError as e:
        raise InvalidDescriptorError(f"remote: {e.message}") from None
    return local_regions, remote_regions
