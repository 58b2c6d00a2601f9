"""POST /v1/chat/completions/batch: many conversations, one request, one choice per conversation.

    {"messages": [[conversation 0], [conversation 1], ...], ...the chat parameters}
        ─► one prompt per conversation, all sent to the backend at once (scheduled together)
        ─► a `chat.completion` whose choice i answers conversation i (streamed: chunks with index i)

Every chat parameter applies to each conversation: sampling, tools, `response_format` and
`structured_outputs` (each answer is constrained on its own).
"""

from __future__ import annotations

from services.router.endpoints.chat import ChatPlan, prepare_conversations
from services.router.generation import PreparedRequest
from services.router.model_context import ModelContext
from services.router.protocol import ChatCompletionRequest, ChatMessage
from shared.errors import InvalidRequestError


class ChatBatchRequest(ChatCompletionRequest):
    messages: list[list[ChatMessage]]  # type: ignore[assignment]  # one conversation per entry


def prepare_chat_batch(body: ChatBatchRequest, request_id: str, model: ModelContext
                       ) -> tuple[PreparedRequest, ChatPlan]:
    if body.n not in (None, 1):
        raise InvalidRequestError("a batch gives one choice per conversation: n must be 1", param="n")
    if body.return_token_ids:
        raise InvalidRequestError("return_token_ids is not supported on batches", param="return_token_ids")
    return prepare_conversations(body, body.messages, request_id, model)
