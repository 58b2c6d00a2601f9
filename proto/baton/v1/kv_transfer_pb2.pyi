from proto.baton.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayoutDesc(_message.Message):
    __slots__ = ("model", "num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "layers")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    layers: _containers.RepeatedCompositeFieldContainer[LayerKVDesc]
    def __init__(self, model: _Optional[str] = ..., num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[LayerKVDesc, _Mapping]]] = ...) -> None: ...

class LayerKVDesc(_message.Message):
    __slots__ = ("num_kv_heads", "head_dim", "num_tensors", "reads_layer", "sliding_window")
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    READS_LAYER_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    num_kv_heads: int
    head_dim: int
    num_tensors: int
    reads_layer: int
    sliding_window: int
    def __init__(self, num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., num_tensors: _Optional[int] = ..., reads_layer: _Optional[int] = ..., sliding_window: _Optional[int] = ...) -> None: ...

class GetAgentRequest(_message.Message):
    __slots__ = ("kind",)
    KIND_FIELD_NUMBER: _ClassVar[int]
    kind: str
    def __init__(self, kind: _Optional[str] = ...) -> None: ...

class AgentInfo(_message.Message):
    __slots__ = ("name", "kind", "metadata", "base_addr", "slot_nbytes", "num_slots", "device_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    SLOT_NBYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    metadata: bytes
    base_addr: int
    slot_nbytes: int
    num_slots: int
    device_id: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., metadata: _Optional[bytes] = ..., base_addr: _Optional[int] = ..., slot_nbytes: _Optional[int] = ..., num_slots: _Optional[int] = ..., device_id: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("handoff_id", "request_id", "layout", "num_blocks", "block_hashes", "prompt_token_ids", "hidden_nbytes", "lease_timeout_ms", "capability")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_NBYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    request_id: str
    layout: KVLayoutDesc
    num_blocks: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    hidden_nbytes: int
    lease_timeout_ms: int
    capability: str
    def __init__(self, handoff_id: _Optional[str] = ..., request_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayoutDesc, _Mapping]] = ..., num_blocks: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., hidden_nbytes: _Optional[int] = ..., lease_timeout_ms: _Optional[int] = ..., capability: _Optional[str] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("block_slots", "present", "hidden_slots", "agent", "lease_timeout_ms")
    BLOCK_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SLOTS_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    block_slots: _containers.RepeatedScalarFieldContainer[int]
    present: _containers.RepeatedScalarFieldContainer[bool]
    hidden_slots: _containers.RepeatedScalarFieldContainer[int]
    agent: AgentInfo
    lease_timeout_ms: int
    def __init__(self, block_slots: _Optional[_Iterable[int]] = ..., present: _Optional[_Iterable[bool]] = ..., hidden_slots: _Optional[_Iterable[int]] = ..., agent: _Optional[_Union[AgentInfo, _Mapping]] = ..., lease_timeout_ms: _Optional[int] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("handoff_id", "capability")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    capability: str
    def __init__(self, handoff_id: _Optional[str] = ..., capability: _Optional[str] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("handoff_id", "first_token_id", "first_logprobs", "hidden_width", "num_hidden_tokens", "capability")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_WIDTH_FIELD_NUMBER: _ClassVar[int]
    NUM_HIDDEN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    first_token_id: int
    first_logprobs: _common_pb2.TokenLogprobs
    hidden_width: int
    num_hidden_tokens: int
    capability: str
    def __init__(self, handoff_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., hidden_width: _Optional[int] = ..., num_hidden_tokens: _Optional[int] = ..., capability: _Optional[str] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("nbytes",)
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    nbytes: int
    def __init__(self, nbytes: _Optional[int] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("handoff_id", "wait_ms", "capability")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    wait_ms: int
    capability: str
    def __init__(self, handoff_id: _Optional[str] = ..., wait_ms: _Optional[int] = ..., capability: _Optional[str] = ...) -> None: ...

class ClaimResponse(_message.Message):
    __slots__ = ("request_id", "layout", "prompt_token_ids", "block_hashes", "first_token_id", "first_logprobs", "block_slots", "hidden_slots", "hidden_width", "num_hidden_tokens", "agent", "claim_timeout_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SLOTS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SLOTS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_WIDTH_FIELD_NUMBER: _ClassVar[int]
    NUM_HIDDEN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    CLAIM_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layout: KVLayoutDesc
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    first_token_id: int
    first_logprobs: _common_pb2.TokenLogprobs
    block_slots: _containers.RepeatedScalarFieldContainer[int]
    hidden_slots: _containers.RepeatedScalarFieldContainer[int]
    hidden_width: int
    num_hidden_tokens: int
    agent: AgentInfo
    claim_timeout_ms: int
    def __init__(self, request_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayoutDesc, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., first_token_id: _Optional[int] = ..., first_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., block_slots: _Optional[_Iterable[int]] = ..., hidden_slots: _Optional[_Iterable[int]] = ..., hidden_width: _Optional[int] = ..., num_hidden_tokens: _Optional[int] = ..., agent: _Optional[_Union[AgentInfo, _Mapping]] = ..., claim_timeout_ms: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("handoff_id", "failed", "capability", "transfers_stopped")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_STOPPED_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    failed: bool
    capability: str
    transfers_stopped: bool
    def __init__(self, handoff_id: _Optional[str] = ..., failed: _Optional[bool] = ..., capability: _Optional[str] = ..., transfers_stopped: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("active_leases", "num_slots", "slots_pinned", "slots_cached", "slot_nbytes", "capacity_bytes", "kv")
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_PINNED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_CACHED_FIELD_NUMBER: _ClassVar[int]
    SLOT_NBYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    active_leases: int
    num_slots: int
    slots_pinned: int
    slots_cached: int
    slot_nbytes: int
    capacity_bytes: int
    kv: _common_pb2.KVSummary
    def __init__(self, active_leases: _Optional[int] = ..., num_slots: _Optional[int] = ..., slots_pinned: _Optional[int] = ..., slots_cached: _Optional[int] = ..., slot_nbytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., kv: _Optional[_Union[_common_pb2.KVSummary, _Mapping]] = ...) -> None: ...

class EncoderOutput(_message.Message):
    __slots__ = ("content_hash", "dtype", "shape", "data")
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    content_hash: bytes
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, content_hash: _Optional[bytes] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutEncoderOutputsRequest(_message.Message):
    __slots__ = ("model", "outputs")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    outputs: _containers.RepeatedCompositeFieldContainer[EncoderOutput]
    def __init__(self, model: _Optional[str] = ..., outputs: _Optional[_Iterable[_Union[EncoderOutput, _Mapping]]] = ...) -> None: ...

class PutEncoderOutputsResponse(_message.Message):
    __slots__ = ("num_stored",)
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    num_stored: int
    def __init__(self, num_stored: _Optional[int] = ...) -> None: ...

class GetEncoderOutputsRequest(_message.Message):
    __slots__ = ("model", "content_hashes", "digests_only")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASHES_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_ONLY_FIELD_NUMBER: _ClassVar[int]
    model: str
    content_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    digests_only: bool
    def __init__(self, model: _Optional[str] = ..., content_hashes: _Optional[_Iterable[bytes]] = ..., digests_only: _Optional[bool] = ...) -> None: ...

class GetEncoderOutputsResponse(_message.Message):
    __slots__ = ("outputs",)
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[EncoderOutput]
    def __init__(self, outputs: _Optional[_Iterable[_Union[EncoderOutput, _Mapping]]] = ...) -> None: ...
