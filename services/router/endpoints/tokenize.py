"""POST /tokenize and /detokenize (vLLM's shapes): the served tokenizer and chat template, no generation.

    {"prompt": "text", "add_special_tokens": true}            ─► {"count", "max_model_len", "tokens",
    {"messages": [...], "add_generation_prompt": true, ...}       "token_strs" (if return_token_strs)}
    {"tokens": [ids]}                                         ─► {"prompt": "text"}

Chat messages render exactly as /v1/chat/completions renders them (tools and template
kwargs included, images and audio as their placeholder runs), so the count is the prompt
size a chat request would have.
"""

from __future__ import annotations

from services.router.chat_messages import encode_rendered, message_dicts, render_prompt
from services.router.media import PendingMedia
from services.router.model_context import ModelContext
from services.router.protocol import DetokenizeRequest, TokenizeRequest
from services.router.shapes import DetokenizeResponse, TokenizeResponse
from services.router.tools import plan_tools
from shared.errors import InvalidRequestError


def tokenize(body: TokenizeRequest, model: ModelContext) -> TokenizeResponse:
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
    pending = PendingMedia()
    if body.messages is not None:
        tools = plan_tools(body.tools, None, True, model.tool_parser).prompt_tools
        text = render_prompt(model, message_dicts(body.messages, model.media, pending), tools,
                             add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
                             continue_final_message=body.continue_final_message,
                             template_kwargs=body.chat_template_kwargs)
        add_special = bool(body.add_special_tokens)  # a rendered template carries its own
    else:
        text = body.prompt or ""
        add_special = body.add_special_tokens is not False
    if pending.kind:
        tokens = encode_rendered(model, text, pending)[0]
    else:
        tokens = list(model.tokenizer(text, add_special_tokens=add_special).input_ids)
    token_strs = model.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=model.max_model_len, tokens=tokens,
                            token_strs=token_strs)


def detokenize(body: DetokenizeRequest, model: ModelContext) -> DetokenizeResponse:
    model.check_token_ids(body.tokens, "tokens")
    return DetokenizeResponse(prompt=model.tokenizer.decode(body.tokens))
