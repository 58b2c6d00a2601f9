from proto.baton.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayoutDesc(_message.Message):
    __slots__ = ("model", "num_layers", "block_size", "num_kv_heads", "head_dim", "dtype")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    model: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    def __init__(self, model: _Optional[str] = ..., num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class HandoffHeader(_message.Message):
    __slots__ = ("handoff_id", "request_id", "prompt_token_ids", "first_token_id", "first_logprobs", "layout", "num_blocks", "hidden_size", "num_hidden_tokens", "lease_timeout_ms")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_HIDDEN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    first_logprobs: _common_pb2.TokenLogprobs
    layout: KVLayoutDesc
    num_blocks: int
    hidden_size: int
    num_hidden_tokens: int
    lease_timeout_ms: int
    def __init__(self, handoff_id: _Optional[str] = ..., request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., first_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., layout: _Optional[_Union[KVLayoutDesc, _Mapping]] = ..., num_blocks: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_hidden_tokens: _Optional[int] = ..., lease_timeout_ms: _Optional[int] = ...) -> None: ...

class KVData(_message.Message):
    __slots__ = ("layer", "data")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    layer: int
    data: bytes
    def __init__(self, layer: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class HiddenData(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class HandoffChunk(_message.Message):
    __slots__ = ("header", "kv", "hidden")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    header: HandoffHeader
    kv: KVData
    hidden: HiddenData
    def __init__(self, header: _Optional[_Union[HandoffHeader, _Mapping]] = ..., kv: _Optional[_Union[KVData, _Mapping]] = ..., hidden: _Optional[_Union[HiddenData, _Mapping]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("handoff_id", "nbytes")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    nbytes: int
    def __init__(self, handoff_id: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("handoff_id", "wait_ms")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    wait_ms: int
    def __init__(self, handoff_id: _Optional[str] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("handoff_id",)
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    def __init__(self, handoff_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("active_leases", "bytes_held", "capacity_bytes")
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    active_leases: int
    bytes_held: int
    capacity_bytes: int
    def __init__(self, active_leases: _Optional[int] = ..., bytes_held: _Optional[int] = ..., capacity_bytes: _Optional[int] = ...) -> None: ...
