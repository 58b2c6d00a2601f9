from proto.baton.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncoderLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "media", "kv_transfer_address")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    media: _containers.RepeatedCompositeFieldContainer[_common_pb2.MediaItem]
    kv_transfer_address: str
    def __init__(self, request_id: _Optional[str] = ..., media: _Optional[_Iterable[_Union[_common_pb2.MediaItem, _Mapping]]] = ..., kv_transfer_address: _Optional[str] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("num_encoded", "num_found", "num_stored")
    NUM_ENCODED_FIELD_NUMBER: _ClassVar[int]
    NUM_FOUND_FIELD_NUMBER: _ClassVar[int]
    NUM_STORED_FIELD_NUMBER: _ClassVar[int]
    num_encoded: int
    num_found: int
    num_stored: int
    def __init__(self, num_encoded: _Optional[int] = ..., num_found: _Optional[int] = ..., num_stored: _Optional[int] = ...) -> None: ...
