"""Dense projections with weights stored the way the device multiplies them fastest.

On x86 CPUs torch's default `F.linear` goes through MKL, whose small-batch
path is slow on AMD parts (we measured 6.7 GB/s effective at batch 16 and 13
GB/s at batch 1 against 32 GB/s of DRAM bandwidth). oneDNN with the weight
reordered once into its blocked layout reaches ~1.7x that at every decode batch
size. Elsewhere (CUDA, or a torch without oneDNN) the plain weight is used.

The reference is `F.linear` on the original weight; results agree to fp32
accumulation-order noise (tested).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# oneDNN picks its blocking for this many rows; decode batches and prefill chunks both run well
_ONEDNN_BATCH_HINT = 128


def onednn_available(device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class LinearWeight:
    """`y = x @ W.T` for a fixed weight W [out_features, in_features]."""

    def __init__(self, weight: torch.Tensor, backend: str = "auto") -> None:
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D, got {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        use_onednn = backend == "onednn" or (
            backend == "auto" and weight.dtype == torch.float32 and onednn_available(weight.device)
        )
        self.backend = "onednn" if use_onednn else "torch"
        self.weight = (
            torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _ONEDNN_BATCH_HINT)
            if use_onednn
            else weight.contiguous()
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, in_features] -> [n, out_features]
        assert x.dim() == 2 and x.shape[1] == self.in_features, f"got {tuple(x.shape)}"
        if self.backend == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, None, "none", [], "")
        return F.linear(x, self.weight)

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * self.weight.element_size()
