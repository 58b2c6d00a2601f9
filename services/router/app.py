"""The router's HTTP app: OpenAI-compatible endpoints over a `GenerationBackend`.

    POST /v1/completions, /v1/chat/completions ─► auth ─► read_body ─► prepare (endpoints/)
        ─► [grammar compiled: a 400 with the compiler's message] ─► Responder (serving.py)
        ─► JSON body, or SSE: data: {chunk}\\n\\n ... data: [DONE]\\n\\n
    POST /v1/chat/completions/batch (one choice per conversation), /v1/responses (responses/)
    POST /tokenize, /detokenize (vLLM's shapes)
    GET /v1/models, /health (200 | 503), /metrics (Prometheus text; no auth, like /health)

One module per endpoint family under endpoints/; this file wires them to routes.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from services.router.auth import KeyGate, KeyLimits, KeyRing, ReleaseKeySlots
from services.router.backend import GenerationBackend
from services.router.chat_messages import media_parts
from services.router.endpoints.chat import ChatFormat, ChatPlan, prepare_chat
from services.router.endpoints.chat_batch import ChatBatchRequest, prepare_chat_batch
from services.router.endpoints.completions import CompletionFormat, prepare_completion
from services.router.endpoints.tokenize import detokenize, tokenize
from services.router.errors import REQUEST_ID_PREFIXES, ErrorBoundary, error_response, install_error_handlers
from services.router.generation import GenerationRunner, PreparedRequest
from services.router.media import RouterMedia, fetch_remote_media, has_video
from services.router.metrics import RouterMetrics
from services.router.model_context import ModelContext
from services.router.openai_format import TokenStrings
from services.router.openapi import publish_request_bodies
from services.router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from services.router.responses.endpoint import ResponsesEndpoint
from services.router.responses.protocol import ResponsesRequest
from services.router.responses.store import MemoryResponseStore, RedisResponseStore, ResponseStore
from services.router.routing import Router
from services.router.serving import Responder, json_response, read_body, request_id
from services.router.settings import RouterSettings
from services.router.shapes import ModelCard, ModelList
from shared.errors import ModelNotFoundError, UnavailableError
from shared.models.generation_config import GenerationDefaults

logger = logging.getLogger(__name__)
ChatT = TypeVar("ChatT", bound=ChatCompletionRequest)

# FastAPI >= 0.165 traces every request itself once a tracer provider is set; the router's own span
# (one per generation request, carrying baton's attributes) takes its place, and probes stay untraced.
_FASTAPI_OPTIONS: dict[str, Any] = (
    {"telemetry": {"tracing": False}} if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {}
)


def create_app(settings: RouterSettings, backend: GenerationBackend, tokenizer: Any, model_name: str,
               defaults: GenerationDefaults | None = None, media: RouterMedia | None = None) -> FastAPI:
    """The router app. The caller owns the backend's lifecycle (start before serving, close after). `media`:
    the model's media side when it reads images or audio (media.py)."""
    model = ModelContext(model_name, tokenizer, settings, defaults or GenerationDefaults(), media)
    service = RouterService(settings, backend, model)
    app = FastAPI(title="baton router", version="0.1.0", **_FASTAPI_OPTIONS)
    app.state.router = service
    install_error_handlers(app, service.record_error_status, settings.hide_internal_errors)
    app.add_middleware(ErrorBoundary)
    gate = KeyGate(KeyRing(settings.api_keys, settings.api_keys_file),
                   KeyLimits(settings.max_concurrent_per_key, settings.requests_per_minute_per_key))
    app.add_middleware(ReleaseKeySlots, gate=gate)
    auth = [Depends(gate.check)]
    app.add_api_route("/health", service.health, methods=["GET"])
    app.add_api_route("/metrics", service.metrics_text, methods=["GET"])
    app.add_api_route("/v1/models", service.list_models, methods=["GET"], dependencies=auth)
    app.add_api_route("/v1/models/{model}", service.get_model, methods=["GET"], dependencies=auth)
    app.add_api_route("/v1/completions", service.completions, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/chat/completions", service.chat_completions, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/chat/completions/batch", service.chat_batch, methods=["POST"], dependencies=auth)
    app.add_api_route("/v1/responses", service.responses, methods=["POST"], dependencies=auth)
    for path, handler in (("/tokenize", service.tokenize), ("/detokenize", service.detokenize)):
        app.add_api_route(path, handler, methods=["POST"], dependencies=auth)
    publish_request_bodies(app, {
        "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
        "/v1/chat/completions/batch": ChatBatchRequest, "/v1/responses": ResponsesRequest,
        "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest,
    })
    return app


def _response_store(settings: RouterSettings) -> ResponseStore:
    if settings.redis_url:
        return RedisResponseStore(settings.redis_url, settings.registry_namespace, settings.responses_ttl_s)
    return MemoryResponseStore(settings.responses_ttl_s, settings.responses_max_stored)


class RouterService:
    """The endpoints' state: settings, backend, the model's context, metrics."""

    def __init__(self, settings: RouterSettings, backend: GenerationBackend, model: ModelContext) -> None:
        self.settings = settings
        self.backend = backend
        self.model = model
        self.tokenizer = model.tokenizer
        self.model_name = model.name
        self.metrics = RouterMetrics()
        router = getattr(backend, "router", None)  # the gRPC backend routes; an in-process engine does not
        if isinstance(router, Router):
            self.metrics.watch_routing(router)
        self.runner = GenerationRunner(backend, model.tokenizer, settings.abort_timeout_s)
        self.responder = Responder(self.runner, self.metrics, settings.hide_internal_errors)
        self.token_strings = TokenStrings(model.tokenizer)
        self.created = int(time.time())
        self.response_store = _response_store(settings)
        self.responses_api = ResponsesEndpoint(model, self.responder, self.response_store)
        logger.info("sampling defaults of %s: %s (from %s)", model.name, model.defaults.as_dict() or "none",
                    model.defaults.source)

    async def close(self) -> None:
        await self.response_store.close()

    # ---- plain endpoints ----------------------------------------------------------------
    async def health(self) -> Response:
        if self.backend.healthy():
            body: dict[str, object] = {"status": "ok", "instance_id": self.settings.instance_id}
            counts = self.backend.instance_counts()
            if counts:
                body["instances"] = counts
            return Response(json.dumps(body), media_type="application/json")
        return error_response(UnavailableError("no healthy backend"))

    async def metrics_text(self) -> Response:
        content, content_type = self.metrics.render()
        return Response(content, media_type=content_type)

    def _model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created, max_model_len=self.settings.max_model_len)

    async def list_models(self) -> Response:
        return json_response(ModelList(data=[self._model_card()]))

    async def get_model(self, model: str) -> Response:
        self.check_model(model)
        return json_response(self._model_card())

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ModelNotFoundError(f"The model `{name}` does not exist.", param="model")

    def record_error_status(self, request: Request, status: int) -> None:
        if request.url.path in REQUEST_ID_PREFIXES:
            self.metrics.record_status(status)

    async def tokenize(self, request: Request) -> Response:
        body = await read_body(request, TokenizeRequest, self.settings.max_request_body_bytes)
        self.check_model(body.model)
        parts = media_parts(body.messages) if body.messages is not None else []
        await fetch_remote_media(self.model.media, parts)
        if has_video(parts):  # decoding a video takes a while: off the event loop
            return json_response(await asyncio.to_thread(tokenize, body, self.model))
        return json_response(tokenize(body, self.model))

    async def detokenize(self, request: Request) -> Response:
        body = await read_body(request, DetokenizeRequest, self.settings.max_request_body_bytes)
        self.check_model(body.model)
        return json_response(detokenize(body, self.model))

    # ---- generation endpoints -------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        timer = self.metrics.timer()
        body = await read_body(request, CompletionRequest, self.settings.max_request_body_bytes)
        self.check_model(body.model)
        prepared = prepare_completion(body, request_id(request), self.model)
        param = "structured_outputs" if body.structured_outputs is not None else "response_format"
        await self.model.grammar.check(prepared.params.structured, param)
        fmt = CompletionFormat(prepared, body, self.model, self.token_strings)
        return await self.responder.respond(request, prepared, fmt, timer)

    async def responses(self, request: Request) -> Response:
        timer = self.metrics.timer()
        body = await read_body(request, ResponsesRequest, self.settings.max_request_body_bytes)
        self.check_model(body.model)
        return await self.responses_api.handle(request, body, timer)

    async def chat_completions(self, request: Request) -> Response:
        return await self._chat(request, ChatCompletionRequest, prepare_chat)

    async def chat_batch(self, request: Request) -> Response:
        return await self._chat(request, ChatBatchRequest, prepare_chat_batch)

    async def _chat(self, request: Request, body_type: type[ChatT],
                    prepare: Callable[[ChatT, str, ModelContext], tuple[PreparedRequest, ChatPlan]]) -> Response:
        timer = self.metrics.timer()
        body = await read_body(request, body_type, self.settings.max_request_body_bytes)
        self.check_model(body.model)
        conversations = body.messages if isinstance(body, ChatBatchRequest) else [body.messages]
        parts = [p for c in conversations for p in media_parts(c)]
        await fetch_remote_media(self.model.media, parts)
        if has_video(parts):  # decoding a video takes a while: off the event loop
            prepared, plan = await asyncio.to_thread(prepare, body, request_id(request), self.model)
        else:
            prepared, plan = prepare(body, request_id(request), self.model)
        await self.model.grammar.check(prepared.params.structured, plan.grammar_param)
        fmt = ChatFormat(prepared, plan, self.model_name, self.token_strings)
        return await self.responder.respond(request, prepared, fmt, timer)
