from proto.baton.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("request", "handoff_id", "kv_transfer_address", "first_token_id", "first_logprobs", "more_choices", "handoff_capability", "keepalive_s")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MORE_CHOICES_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_S_FIELD_NUMBER: _ClassVar[int]
    request: _common_pb2.GenerateRequest
    handoff_id: str
    kv_transfer_address: str
    first_token_id: int
    first_logprobs: _common_pb2.TokenLogprobs
    more_choices: _containers.RepeatedCompositeFieldContainer[_common_pb2.FirstToken]
    handoff_capability: str
    keepalive_s: float
    def __init__(self, request: _Optional[_Union[_common_pb2.GenerateRequest, _Mapping]] = ..., handoff_id: _Optional[str] = ..., kv_transfer_address: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., more_choices: _Optional[_Iterable[_Union[_common_pb2.FirstToken, _Mapping]]] = ..., handoff_capability: _Optional[str] = ..., keepalive_s: _Optional[float] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finished", "finish_reason", "num_cached_tokens", "index", "prompt_logprobs", "keepalive")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    finished: bool
    finish_reason: str
    num_cached_tokens: int
    index: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    keepalive: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., index: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., keepalive: _Optional[bool] = ...) -> None: ...

class DecodeLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
