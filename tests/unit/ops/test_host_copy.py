"""Packing a step's host values into one buffer (shared/ops/host_copy.py): every part comes back as it went in."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.ops.host_copy import pack_host, pack_to_device, unpack


def _parts() -> list[torch.Tensor]:
    return [torch.tensor([3, 1, 4], dtype=torch.int64), torch.tensor([7], dtype=torch.int32),
            torch.arange(15, dtype=torch.int32).view(3, 5), torch.tensor([], dtype=torch.int64),
            torch.tensor([-1, 2**40], dtype=torch.int64), torch.tensor([0.5, -2.0], dtype=torch.float32)]


def test_pack_and_unpack_round_trip_at_aligned_offsets() -> None:
    parts = _parts()
    buffer, offsets = pack_host(parts)
    assert buffer.dtype == torch.uint8 and all(at % 16 == 0 for at in offsets)
    assert offsets == sorted(offsets) and buffer.numel() >= offsets[-1] + 8
    for got, want in zip(unpack(buffer, parts, offsets), parts, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert got.is_contiguous()  # kernels read block tables with a unit last stride


def test_a_copy_of_the_buffer_unpacks_the_same() -> None:
    parts = _parts()
    buffer, offsets = pack_host(parts)
    copy = buffer.clone()
    buffer.zero_()  # the views of the copy do not alias the original
    assert all(torch.equal(g, w) for g, w in zip(unpack(copy, parts, offsets), parts, strict=True))


def test_numpy_arrays_pack_as_the_tensors_would() -> None:
    parts = _parts()
    arrays = [p.numpy() for p in parts]
    buffer, offsets = pack_host(arrays)
    assert offsets == pack_host(parts)[1]
    for got, want in zip(unpack(buffer, arrays, offsets), parts, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_pack_to_device_on_the_cpu() -> None:
    table = np.zeros((2, 3), dtype=np.int64)
    table[1, :2] = [5, 6]
    got = pack_to_device([([1, 2], torch.int64), ([], torch.int64), (torch.ones(2, 3, dtype=torch.int64), torch.int32),
                          (table, torch.int32)], "cpu")
    assert torch.equal(got[0], torch.tensor([1, 2])) and got[1].numel() == 0 and got[1].dtype == torch.int64
    assert got[2].dtype == torch.int32 and torch.equal(got[2], torch.ones(2, 3, dtype=torch.int32))
    assert got[3].dtype == torch.int32 and got[3].tolist() == [[0, 0, 0], [5, 6, 0]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pack_to_device_on_cuda() -> None:
    parts = _parts()
    got = pack_to_device([(p, p.dtype) for p in parts], "cuda")
    for g, w in zip(got, parts, strict=True):
        assert g.is_cuda and torch.equal(g.cpu(), w)
