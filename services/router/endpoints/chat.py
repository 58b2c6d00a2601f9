"""POST /v1/chat/completions: messages to `chat.completion[.chunk]` objects, with tools and reasoning.

    body ─► tool plan (tools.py) + output constraint (structured.py; at most one)
         ─► messages ─► chat template (tools rendered, or the default tool prompt) ─► tokens
         ─► PreparedRequest (+ ChatPlan: how each choice's text is read back)
    text ─► ChoiceOutput per choice (reasoning parser, tool-call parser) ─► message / deltas

Streams: a role chunk per choice, then content / reasoning / tool-call deltas (a call's
id, type and name first, then argument fragments), then a finish chunk per choice
(`tool_calls` when the choice called tools and stopped on its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from services.router.chat_messages import encode_rendered, message_dicts, render_prompt
from services.router.chat_output import ChoiceOutput, MessageDelta
from services.router.engine_features import THINKING_BUDGET, require
from services.router.generation import Delta, PreparedRequest
from services.router.media import PendingMedia
from services.router.model_context import ModelContext
from services.router.openai_format import Collected, TokenStrings, clamp_logprob, prompt_logprobs_json, usage
from services.router.protocol import ChatCompletionRequest, ChatMessage
from services.router.reasoning_parsers import ReasoningFormat, ReasoningParser
from services.router.sampling import Asked, check_logprobs, max_tokens, sampling_params, stop_strings
from services.router.shapes import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
    FunctionCallDelta,
    FunctionCallOut,
    TokenLogprob,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from services.router.structured import grammar_from_body
from services.router.tools import ToolPlan, plan_tools
from shared.engine.request import TokenLogprobs
from shared.errors import InvalidRequestError
from shared.structured.spec import GrammarSpec, ReasoningSpec


@dataclass(frozen=True)
class ChatPlan:
    """How a chat request's output is read back, beside its PreparedRequest."""

    tools: ToolPlan
    reasoning: ReasoningFormat | None = None
    thinking_at_start: bool = False
    include_reasoning: bool = True
    return_token_ids: bool = False
    grammar_param: str = "response_format"  # the field a grammar that does not compile came from


def _grammar(body: ChatCompletionRequest, tools: ToolPlan) -> tuple[GrammarSpec | None, str]:
    asked = grammar_from_body(body)
    param = "structured_outputs" if body.structured_outputs is not None else "response_format"
    if tools.grammar is None:
        return asked, param
    if asked is not None:
        raise InvalidRequestError("a forced tool call and response_format/structured_outputs cannot be combined",
                                  param="tool_choice")
    return tools.grammar, "tool_choice"


def _reasoning_spec(body: ChatCompletionRequest, model: ModelContext, grammar: GrammarSpec | None,
                    thinking_at_start: bool) -> ReasoningSpec | None:
    fmt = model.reasoning
    if body.thinking_token_budget is not None:
        if fmt is None:
            raise InvalidRequestError("thinking_token_budget needs a reasoning model: this server runs no "
                                      "reasoning parser (--reasoning-parser)", param="thinking_token_budget")
        require(THINKING_BUDGET, "thinking_token_budget")
    if fmt is None or (grammar is None and body.thinking_token_budget is None):
        return None
    return ReasoningSpec(model.marker_ids(fmt.start), model.marker_ids(fmt.end), thinking_at_start,
                         body.thinking_token_budget)


def prepare_chat(body: ChatCompletionRequest, request_id: str, model: ModelContext
                 ) -> tuple[PreparedRequest, ChatPlan]:
    return prepare_conversations(body, [body.messages], request_id, model)


def prepare_conversations(body: ChatCompletionRequest, conversations: Sequence[Sequence[ChatMessage]],
                          request_id: str, model: ModelContext) -> tuple[PreparedRequest, ChatPlan]:
    """One prompt per conversation (a batch has several), all sampled with the body's parameters."""
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
    if not conversations or len(conversations) > model.settings.max_prompts:
        raise InvalidRequestError(f"give 1 to {model.settings.max_prompts} conversations", param="messages")
    if any(len(messages) > model.settings.max_messages for messages in conversations):
        raise InvalidRequestError(f"a conversation may have at most {model.settings.max_messages} messages",
                                  param="messages")
    tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, model.tool_parser)
    grammar, grammar_param = _grammar(body, tools)
    pending = [PendingMedia() for _ in conversations]
    texts = [render_prompt(model, message_dicts(messages, model.media, media), tools.prompt_tools,
                           add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
                           continue_final_message=body.continue_final_message,
                           template_kwargs=body.chat_template_kwargs)
             for messages, media in zip(conversations, pending, strict=True)]
    encoded = [encode_rendered(model, text, media) for text, media in zip(texts, pending, strict=True)]
    prompts = [ids for ids, _ in encoded]
    fmt = model.reasoning
    # one template renders them all: a thinking section it opens, it opens for every conversation
    thinking_at_start = fmt is not None and texts[0].rstrip().endswith(fmt.start.rstrip())
    by_new_name = body.max_completion_tokens is not None
    asked = Asked(
        max_tokens=body.max_completion_tokens if by_new_name else body.max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        prompt_param="messages", max_tokens_param="max_completion_tokens" if by_new_name else "max_tokens",
        logprobs_param="top_logprobs",
    )
    check_logprobs(asked, model.settings)
    limit = model.settings.max_tokens_limit
    num_tokens = min(max_tokens(asked, len(prompt), model.max_model_len, limit) for prompt in prompts)
    params = sampling_params(body, num_tokens, asked.logprobs, model.settings, model.defaults, model.vocab_size)
    params = replace(params, structured=grammar,
                     reasoning=_reasoning_spec(body, model, grammar, thinking_at_start))
    keep_special = tools.needs_special_tokens or (fmt is not None and fmt.special_tokens)
    prepared = PreparedRequest(
        request_id=request_id, prompts=prompts, params=params, stop=stop_strings(body, model.settings),
        media=[items for _, items in encoded] if any(items for _, items in encoded) else [],
        stream=bool(body.stream),
        include_usage=bool(body.stream and body.stream_options and body.stream_options.include_usage),
        include_stop_str=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens and not keep_special,
    )
    plan = ChatPlan(tools, fmt, thinking_at_start, body.include_reasoning, body.return_token_ids, grammar_param)
    return prepared, plan


def choice_output(plan: ChatPlan) -> ChoiceOutput:
    """A fresh reader of one choice's text, as `plan` says."""
    reasoning = ReasoningParser(plan.reasoning, plan.thinking_at_start) if plan.reasoning else None
    return ChoiceOutput(reasoning, plan.tools.parser(), plan.include_reasoning)


def _tool_call_deltas(message: MessageDelta) -> list[ToolCallDelta] | None:
    if not message.calls:
        return None
    return [ToolCallDelta(index=c.index, id=c.id, type="function" if c.id else None,
                          function=FunctionCallDelta(name=c.name, arguments=c.arguments)) for c in message.calls]


class ChatFormat:
    """/v1/chat/completions: `chat.completion[.chunk]` objects, `logprobs.content[]` entries."""

    def __init__(self, prepared: PreparedRequest, plan: ChatPlan, model_name: str, strings: TokenStrings) -> None:
        self.prepared = prepared
        self.plan = plan
        self.model_name = model_name
        self.strings = strings
        self.wants_logprobs = prepared.params.logprobs is not None
        self._outputs: dict[int, ChoiceOutput] = {}
        self._called: set[int] = set()

    def _head(self) -> dict[str, Any]:
        return {"id": self.prepared.request_id, "created": self.prepared.created, "model": self.model_name}

    def _output(self, index: int) -> ChoiceOutput:
        out = self._outputs.get(index)
        if out is None:
            out = self._outputs[index] = choice_output(self.plan)
        return out

    def _entry(self, entry: TokenLogprobs) -> TokenLogprob:
        text, raw = self.strings.get(entry.token_id)
        top = []
        for token_id, lp in entry.top:
            top_text, top_raw = self.strings.get(token_id)
            top.append(TopLogprob(token=top_text, logprob=clamp_logprob(lp), bytes=top_raw))
        return TokenLogprob(token=text, logprob=clamp_logprob(entry.logprob), bytes=raw, top_logprobs=top)

    def _logprobs(self, entries: Sequence[TokenLogprobs]) -> ChatLogprobs | None:
        if not self.wants_logprobs:
            return None
        return ChatLogprobs(content=[self._entry(e) for e in entries])

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and index in self._called else reason

    def _prompt_ids(self) -> dict[str, Any]:
        """vLLM puts the prompt's ids on the response (a batch's: the first conversation's, as below)."""
        return {"prompt_token_ids": self.prepared.prompts[0]} if self.plan.return_token_ids else {}

    def response(self, result: Collected) -> BaseModel:
        choices = []
        prompt_logprobs = None
        for index, c in result.in_order():
            out = self._output(index)
            message = out.feed(c.text).extend(out.finish())
            calls = [ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments_json))
                     for call in out.calls]
            if calls or message.calls:
                self._called.add(index)
            content = message.content if message.content or not calls else None
            choices.append(ChatChoice(
                index=index, message=AssistantMessage(content=content, reasoning=message.reasoning or None,
                                                      tool_calls=calls),
                logprobs=self._logprobs(c.logprobs), finish_reason=self._finish_reason(index, c.finish_reason),
                token_ids=c.token_ids if self.plan.return_token_ids else None))
            prompt_logprobs = prompt_logprobs or prompt_logprobs_json(c.prompt_logprobs, self.strings)
        return ChatCompletion(**self._head(), choices=choices, prompt_logprobs=prompt_logprobs, **self._prompt_ids(),
                              usage=usage(self.prepared, result.num_tokens, result.num_cached_tokens))

    def start_chunks(self) -> list[BaseModel]:
        chunks: list[BaseModel] = []
        for index in range(self.prepared.num_choices):
            choice = ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
            chunks.append(ChatCompletionChunk(**self._head(), choices=[choice], **(self._prompt_ids() if not index else {})))
        return chunks

    def chunks(self, delta: Delta) -> list[BaseModel]:
        index = delta.index
        out = self._output(index)
        message = out.feed(delta.text)
        if delta.finish_reason is not None:
            message.extend(out.finish())
        if message.calls:
            self._called.add(index)
        chunks: list[BaseModel] = []
        wants_ids = self.plan.return_token_ids and bool(delta.token_ids)
        if not message.empty or (self.wants_logprobs and delta.logprobs) or wants_ids:
            content = message.content if message.content or not (message.reasoning or message.calls) else None
            fragment = DeltaMessage(content=content, reasoning=message.reasoning or None,
                                    tool_calls=_tool_call_deltas(message))
            chunks.append(ChatCompletionChunk(**self._head(), choices=[ChatStreamChoice(
                index=index, delta=fragment, logprobs=self._logprobs(delta.logprobs),
                token_ids=delta.token_ids if self.plan.return_token_ids else None)]))
        if delta.finish_reason is not None:
            chunks.append(ChatCompletionChunk(**self._head(), choices=[ChatStreamChoice(
                index=index, delta=DeltaMessage(), finish_reason=self._finish_reason(index, delta.finish_reason))]))
        return chunks

    def usage_chunk(self, value: Usage) -> BaseModel:
        return ChatCompletionChunk(**self._head(), choices=[], usage=value)
