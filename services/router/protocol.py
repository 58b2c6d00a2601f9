"""OpenAI request bodies (completions, chat, tokenize), as pydantic models.

Requests accept what OpenAI's API and vLLM's extensions send; unknown fields are
ignored, as OpenAI does. Support for a field is decided when a request is prepared
(sampling.py, endpoints/), so that each refusal carries a clear message and `param`.
Response bodies live in shapes.py.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs` extra body: exactly one of the constraint fields."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None


class SamplingRequest(_Request):
    """Fields common to /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the one model served
    temperature: float | None = None  # None: the model's generation_config, else 1
    top_p: float | None = None
    top_k: int | None = None  # vLLM: 0 or -1 disables
    min_p: float | None = None  # vLLM
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM
    include_stop_str_in_output: bool = False  # vLLM
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    max_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # vLLM
    min_tokens: int = 0  # vLLM
    prompt_logprobs: int | None = None  # vLLM
    return_token_ids: bool = False  # vLLM: the choices' token_ids and the prompt_token_ids
    skip_special_tokens: bool = True  # vLLM
    stream_interval: int | None = None  # vLLM: tokens per streamed chunk (the larger of this and the server's)
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM
    user: str | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(_Request):
    """One part of a message's content; only text parts reach a text-only model."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # role "tool": which call this result answers
    reasoning: str | None = None  # an assistant turn's thinking (vLLM's field)
    reasoning_content: str | None = None  # the older name of the same


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None  # none | auto | required | {"type": "function", ...}
    parallel_tool_calls: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM: e.g. {"enable_thinking": false}
    add_generation_prompt: bool = True  # vLLM
    continue_final_message: bool = False  # vLLM
    include_reasoning: bool = True  # vLLM: False drops the reasoning from the answer
    thinking_token_budget: int | None = None  # vLLM: at most this many thinking tokens


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a plain prompt, or chat messages rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]
