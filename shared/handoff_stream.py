"""A handoff as plain data: its header, its parts, and the check that a stream of parts is whole.

No protobuf here (`shared.wire` converts); kv_transfer's store holds these.
One handoff is a header then its data parts::

    HandoffInfo ─► KVLayerData(layer 0) ... KVLayerData(layer L-1) ─► HiddenStateData (if announced)
                   [num_blocks, 2, block_size, num_kv_heads, head_dim] bytes each

Layers may come in any order but each exactly once; the hidden states
([num_hidden_tokens, hidden_size]) come last. Tensor bytes are the host's
native order (little-endian on every platform baton runs on) in the layout's
dtype. `handoff_info`/`handoff_parts` cut a `KVHandoff` into parts;
`payload_to_handoff` puts a complete payload back into tensors.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from shared.engine.handoff import KVHandoff
from shared.engine.request import TokenLogprobs
from shared.errors import InvalidRequestError
from shared.kv.layout import KVLayout


@dataclass
class HandoffInfo:
    """The header of a handoff: what the data that follows is, and for whom."""

    handoff_id: str
    request_id: str
    model: str  # model identity; decode checks it against its own
    layout: KVLayout  # num_blocks = blocks per layer in this handoff
    prompt_token_ids: list[int]
    first_token_id: int
    first_logprobs: TokenLogprobs | None
    hidden_size: int
    num_hidden_tokens: int  # 0 = no hidden states sent
    lease_timeout_ms: int = 0  # 0 = the store's default

    @property
    def layer_nbytes(self) -> int:
        return self.layout.layer_nbytes

    @property
    def hidden_nbytes(self) -> int:
        return self.num_hidden_tokens * self.hidden_size * self.layout.itemsize

    @property
    def total_nbytes(self) -> int:
        return self.layout.total_nbytes + self.hidden_nbytes


@dataclass(frozen=True)
class KVLayerData:
    layer: int
    data: bytes  # [num_blocks, 2, block_size, num_kv_heads, head_dim] in the layout dtype


@dataclass(frozen=True)
class HiddenStateData:
    data: bytes  # [num_hidden_tokens, hidden_size] in the layout dtype


HandoffPart = HandoffInfo | KVLayerData | HiddenStateData


@dataclass
class HandoffPayload:
    """A complete handoff as raw bytes: what kv_transfer stores and streams back."""

    info: HandoffInfo
    kv_layers: list[bytes]  # one per layer, in layer order
    hidden: bytes  # b"" when num_hidden_tokens == 0

    def parts(self) -> Iterator[HandoffPart]:
        yield self.info
        for layer, data in enumerate(self.kv_layers):
            yield KVLayerData(layer=layer, data=data)
        if self.info.num_hidden_tokens:
            yield HiddenStateData(data=self.hidden)


class HandoffAssembly:
    """Collects the data parts of one handoff, checking each against the header."""

    def __init__(self, info: HandoffInfo) -> None:
        self.info = info
        self._kv_layers: list[bytes | None] = [None] * info.layout.num_layers
        self._hidden: bytes | None = None
        self.nbytes_received = 0

    def add(self, part: KVLayerData | HiddenStateData) -> None:
        info = self.info
        if self._hidden is not None:
            raise InvalidRequestError(f"handoff {info.handoff_id}: data after the hidden states")
        if isinstance(part, KVLayerData):
            if not 0 <= part.layer < len(self._kv_layers):
                raise InvalidRequestError(
                    f"handoff {info.handoff_id}: layer {part.layer} outside [0, {len(self._kv_layers)})"
                )
            if self._kv_layers[part.layer] is not None:
                raise InvalidRequestError(f"handoff {info.handoff_id}: layer {part.layer} sent twice")
            self._check_size("kv layer", len(part.data), info.layer_nbytes)
            self._kv_layers[part.layer] = part.data
        else:
            if info.num_hidden_tokens == 0:
                raise InvalidRequestError(f"handoff {info.handoff_id}: hidden states not announced")
            self._check_size("hidden states", len(part.data), info.hidden_nbytes)
            self._hidden = part.data
        self.nbytes_received += len(part.data)

    def _check_size(self, what: str, got: int, expected: int) -> None:
        if got != expected:
            raise InvalidRequestError(
                f"handoff {self.info.handoff_id}: {what} has {got} bytes, header implies {expected}"
            )

    @property
    def complete(self) -> bool:
        hidden_done = self.info.num_hidden_tokens == 0 or self._hidden is not None
        return hidden_done and all(data is not None for data in self._kv_layers)

    def finish(self) -> HandoffPayload:
        if not self.complete:
            missing = [i for i, data in enumerate(self._kv_layers) if data is None]
            raise InvalidRequestError(
                f"handoff {self.info.handoff_id} incomplete: missing layers {missing[:8]}"
                f"{'...' if len(missing) > 8 else ''}, hidden states "
                f"{'missing' if self.info.num_hidden_tokens and self._hidden is None else 'ok'}"
            )
        kv_layers = [data for data in self._kv_layers if data is not None]
        return HandoffPayload(info=self.info, kv_layers=kv_layers, hidden=self._hidden or b"")


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's raw bytes (contiguous, native order), e.g. one layer's KV for a KVLayerData."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _copy_bytes_into(dest: torch.Tensor, data: bytes) -> None:
    """Copy raw bytes into a contiguous tensor of the same byte size."""
    with warnings.catch_warnings():
        # frombuffer warns that `bytes` is read-only; we only read it, into our own tensor
        warnings.simplefilter("ignore", UserWarning)
        source = torch.frombuffer(data, dtype=torch.uint8)
    dest.reshape(-1).view(torch.uint8).copy_(source)


def handoff_info(
    handoff: KVHandoff, *, handoff_id: str, request_id: str, model: str, lease_timeout_ms: int = 0
) -> HandoffInfo:
    """The header describing `handoff` (layout from its kv tensor)."""
    kv = handoff.kv  # [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
    if kv.dim() != 6 or kv.shape[2] != 2 or kv.shape[3] != handoff.block_size:
        raise InvalidRequestError(f"handoff kv has shape {tuple(kv.shape)}, not a KVLayout")
    hidden = handoff.hidden_states  # [num_hidden_tokens, hidden_size]
    num_hidden_tokens = hidden.shape[0] if hidden.dim() == 2 else 0
    layout = KVLayout(
        num_layers=kv.shape[0],
        num_blocks=kv.shape[1],
        block_size=handoff.block_size,
        num_kv_heads=kv.shape[4],
        head_dim=kv.shape[5],
        dtype=kv.dtype,
    )
    return HandoffInfo(
        handoff_id=handoff_id,
        request_id=request_id,
        model=model,
        layout=layout,
        prompt_token_ids=list(handoff.prompt_token_ids),
        first_token_id=handoff.first_token_id,
        first_logprobs=handoff.first_logprobs,
        hidden_size=hidden.shape[-1] if hidden.dim() == 2 else 0,
        num_hidden_tokens=num_hidden_tokens if hidden.numel() else 0,
        lease_timeout_ms=lease_timeout_ms,
    )


def handoff_parts(handoff: KVHandoff, info: HandoffInfo) -> Iterator[HandoffPart]:
    """Header, then one layer at a time (bytes made lazily), then hidden states (layout dtype)."""
    yield info
    for layer in range(info.layout.num_layers):
        yield KVLayerData(layer=layer, data=tensor_bytes(handoff.kv[layer]))
    if info.num_hidden_tokens:
        yield HiddenStateData(data=tensor_bytes(handoff.hidden_states.to(info.layout.dtype)))


def payload_to_handoff(payload: HandoffPayload) -> KVHandoff:
    """Tensors (new CPU memory) from a complete payload."""
    info = payload.info
    kv = torch.empty(info.layout.shape, dtype=info.layout.dtype)
    for layer, data in enumerate(payload.kv_layers):
        _copy_bytes_into(kv[layer], data)
    hidden = torch.empty((info.num_hidden_tokens, info.hidden_size), dtype=info.layout.dtype)
    if info.num_hidden_tokens:
        _copy_bytes_into(hidden, payload.hidden)
    return KVHandoff(
        prompt_token_ids=list(info.prompt_token_ids),
        first_token_id=info.first_token_id,
        first_logprobs=info.first_logprobs,
        block_size=info.layout.block_size,
        kv=kv,
        hidden_states=hidden,
    )
