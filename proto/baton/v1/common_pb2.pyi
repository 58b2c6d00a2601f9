from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "min_tokens", "logprobs", "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "structured", "reasoning", "prompt_logprobs", "stream_interval")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    logprobs: int
    n: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.RepeatedCompositeFieldContainer[LogitBias]
    min_p: float
    structured: GrammarSpec
    reasoning: ReasoningSpec
    prompt_logprobs: int
    stream_interval: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., logprobs: _Optional[int] = ..., n: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Iterable[_Union[LogitBias, _Mapping]]] = ..., min_p: _Optional[float] = ..., structured: _Optional[_Union[GrammarSpec, _Mapping]] = ..., reasoning: _Optional[_Union[ReasoningSpec, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ..., stream_interval: _Optional[int] = ...) -> None: ...

class LogitBias(_message.Message):
    __slots__ = ("token_id", "bias")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    bias: float
    def __init__(self, token_id: _Optional[int] = ..., bias: _Optional[float] = ...) -> None: ...

class GrammarSpec(_message.Message):
    __slots__ = ("kind", "source", "any_whitespace")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ANY_WHITESPACE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    source: str
    any_whitespace: bool
    def __init__(self, kind: _Optional[str] = ..., source: _Optional[str] = ..., any_whitespace: _Optional[bool] = ...) -> None: ...

class ReasoningSpec(_message.Message):
    __slots__ = ("start_token_ids", "end_token_ids", "thinking_at_start", "budget")
    START_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    THINKING_AT_START_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    start_token_ids: _containers.RepeatedScalarFieldContainer[int]
    end_token_ids: _containers.RepeatedScalarFieldContainer[int]
    thinking_at_start: bool
    budget: int
    def __init__(self, start_token_ids: _Optional[_Iterable[int]] = ..., end_token_ids: _Optional[_Iterable[int]] = ..., thinking_at_start: _Optional[bool] = ..., budget: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprobs: TokenLogprobs
    def __init__(self, token_id: _Optional[int] = ..., logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ...) -> None: ...

class MediaItem(_message.Message):
    __slots__ = ("kind", "offset", "num_tokens", "content_hash", "data", "audio_format")
    KIND_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FORMAT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    offset: int
    num_tokens: int
    content_hash: bytes
    data: bytes
    audio_format: str
    def __init__(self, kind: _Optional[str] = ..., offset: _Optional[int] = ..., num_tokens: _Optional[int] = ..., content_hash: _Optional[bytes] = ..., data: _Optional[bytes] = ..., audio_format: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "output_token_ids", "media")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    media: _containers.RepeatedCompositeFieldContainer[MediaItem]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., media: _Optional[_Iterable[_Union[MediaItem, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_kv_blocks_total", "num_kv_blocks_free", "kv")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_kv_blocks_total: int
    num_kv_blocks_free: int
    kv: KVSummary
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_kv_blocks_total: _Optional[int] = ..., num_kv_blocks_free: _Optional[int] = ..., kv: _Optional[_Union[KVSummary, _Mapping]] = ...) -> None: ...

class KVSummary(_message.Message):
    __slots__ = ("block_size", "hash_salt", "block_hashes")
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_SALT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_size: int
    hash_salt: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_size: _Optional[int] = ..., hash_salt: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...
