from proto.baton.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request", "handoff_id", "kv_transfer_address", "handoff_capability")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    request: _common_pb2.GenerateRequest
    handoff_id: str
    kv_transfer_address: str
    handoff_capability: str
    def __init__(self, request: _Optional[_Union[_common_pb2.GenerateRequest, _Mapping]] = ..., handoff_id: _Optional[str] = ..., kv_transfer_address: _Optional[str] = ..., handoff_capability: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("handoff_id", "first_token_id", "first_logprobs", "num_prompt_tokens", "num_cached_tokens", "finish_reason", "more_choices", "prompt_logprobs")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MORE_CHOICES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    handoff_id: str
    first_token_id: int
    first_logprobs: _common_pb2.TokenLogprobs
    num_prompt_tokens: int
    num_cached_tokens: int
    finish_reason: str
    more_choices: _containers.RepeatedCompositeFieldContainer[_common_pb2.FirstToken]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, handoff_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ..., more_choices: _Optional[_Iterable[_Union[_common_pb2.FirstToken, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
