"""Router settings: environment variables `BATON_ROUTER_<FIELD>`, parsed once in `services.router.main`.

For example `BATON_ROUTER_PORT=8000`, `BATON_ROUTER_API_KEYS=key1,key2`.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from shared.cache_dir import DEFAULT_CACHE_DIR


class RouterSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BATON_ROUTER_", extra="ignore", frozen=True)

    host: str = Field(default="127.0.0.1", description="interface the HTTP server binds")
    port: int = Field(default=8000, ge=0, le=65535, description="HTTP port; 0 = let the OS pick")
    model: str = Field(default="smollm2-135m", description="model spec (alias, .gguf file or HF directory)")
    served_model_name: str | None = Field(
        default=None, description="the name clients send as `model`; default: the model spec"
    )
    cache_dir: Path = Field(default=DEFAULT_CACHE_DIR, description="where converted models (the tokenizer) live")
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="accepted bearer keys, comma-separated; empty (and no keys file) "
                                          "turns auth off"
    )
    api_keys_file: Path | None = Field(default=None, description="more keys, one per line (# comments); re-read "
                                       "when it changes, so keys rotate without a restart")
    max_concurrent_per_key: int = Field(default=0, ge=0, description="requests one API key may have in flight "
                                        "(429 with Retry-After past it); 0 = no limit")
    requests_per_minute_per_key: float = Field(default=0.0, ge=0, description="requests one API key may start "
                                               "a minute (a bucket of a minute's worth); 0 = no limit")
    instance_id: str = Field(default_factory=lambda: f"router-{uuid.uuid4().hex[:12]}",
                             description="named by /health, so a supervisor knows it reached this router")
    mode: Literal["disagg", "colocated"] = Field(default="disagg", description="how the backend serves requests")
    routing_policy: Literal["kv", "least_loaded", "round_robin"] = Field(
        default="kv", description="how prefill and decode instances are chosen: kv (the cost model in "
        "shared/registry/cost_model.py: prefix hits, queues, decode load and KV), least_loaded or round_robin")
    local_prefill_max_tokens: int = Field(
        default=0, ge=-1, description="disagg: a request whose chosen decode instance lacks at most this many "
        "of its prompt tokens (short prompt, or a long prefix hit there) is prefilled on that decode instance, "
        "with no handoff; 0 = never, -1 = the cost model's break-even length")
    routed_prefix_ttl_s: float = Field(
        default=10.0, ge=0, description="kv policy: how long the router counts a prompt's prefix as held by "
        "the instance it sent it to, before that instance's KV report can show it "
        "(shared/registry/routed_prefixes.py); 0 = reports only")
    migration_limit: int = Field(default=3, ge=0, description="times one request may move to another "
                                 "instance when its decode stream breaks (it resumes from the tokens already "
                                 "streamed); past it the client gets the error; 0 = never")
    decode_stall_timeout_s: float = Field(default=30.0, ge=0, description="a decode stream that sends "
                                          "nothing (no token, no keepalive) for this long is dead (migrated); 0 = off")
    migration_wait_s: float = Field(default=15.0, ge=0, description="how long a request whose instances all "
                                    "failed waits for a new one (a restart) before it fails")
    redis_url: str = Field(default="", description="registry; empty = use static_instances")
    tls_dir: Path | None = Field(default=None, description="mutual TLS on every internal gRPC call: a directory "
                                 "with ca.pem and this service's <service>.pem and <service>-key.pem "
                                 "(`baton certs` makes a set); unset = plaintext")
    internal_token: str = Field(default="", repr=False, description="shared token every internal gRPC call "
                                "carries and every server requires (health checks excepted); empty = open")
    registry_namespace: str = Field(default="baton", description="registry key namespace")
    static_instances: str = Field(default="", description="without Redis: 'service=host:port,...' to poll")
    max_model_len: int = Field(
        default=4096, ge=2, description="context length in tokens (prompt + completion); match the engines'"
    )
    max_request_body_bytes: int = Field(
        default=4 << 20, ge=1024, description="larger request bodies are refused with 400"
    )
    max_stop_strings: int = Field(default=16, ge=0, le=256, description="most stop strings one request may give")
    max_stop_string_chars: int = Field(default=256, ge=1, description="longest stop string accepted")
    max_logprobs: int = Field(default=20, ge=0, le=20, description="most top logprobs one token may ask for")
    max_tokens_limit: int = Field(default=0, ge=0, description="most completion tokens one request may ask for "
                                  "(more is a 400; unset gets this); 0 = the context's remainder")
    max_n: int = Field(default=8, ge=1, le=128, description="most choices (n) one request may ask for")
    max_messages: int = Field(default=1024, ge=1, description="most messages in one conversation")
    max_schema_bytes: int = Field(default=256 << 10, ge=0, description="largest response_format / structured "
                                  "outputs schema or grammar (bytes; compiling grows with it); 0 = any size")
    max_prompts: int = Field(
        default=64, ge=1, le=1024, description="most prompts (completions) or conversations (batch) in one request"
    )
    generation_config: str = Field(
        default="auto", description="sampling defaults: auto (the model's generation_config), vllm (none) or a dir"
    )
    tool_call_parser: str = Field(
        default="", description="how tool_choice=auto reads calls: hermes, llama3_json, pythonic, gemma4 (empty: hermes)"
    )
    reasoning_parser: str = Field(default="", description="think or gemma4: split reasoning from the answer (empty: off)")
    responses_ttl_s: float = Field(default=3600.0, gt=0, description="how long /v1/responses answers stay "
                                   "continuable by previous_response_id")
    responses_max_stored: int = Field(default=10000, ge=1, description="without Redis: most responses kept")
    abort_timeout_s: float = Field(default=10.0, gt=0, description="time allowed for a backend abort call")
    shutdown_grace_s: float = Field(default=10.0, ge=0, description="time requests in flight get on stop")
    media_url_allowlist: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="hosts (comma-separated; '.example.com' allows its subdomains) whose "
        "http(s) image and video URLs the router fetches; empty: data: URLs only")
    media_fetch_timeout_s: float = Field(default=10.0, gt=0, le=120,
                                         description="time allowed to fetch one image or video URL")
    media_max_image_bytes: int = Field(default=20 * 2**20, ge=1, description="largest image file accepted")
    media_max_image_pixels: int = Field(default=40_000_000, ge=1, description="most pixels an image may have")
    media_max_audio_bytes: int = Field(default=25 * 2**20, ge=1, description="largest audio file accepted")
    media_max_audio_seconds: float = Field(default=30.0, gt=0, le=30.0,
                                           description="longest audio clip accepted (the model reads at most 30 s)")
    media_max_items: int = Field(default=8, ge=0, le=64,
                                 description="most images, audio clips and videos in one request")
    media_max_video_bytes: int = Field(default=64 * 2**20, ge=1, description="largest video file accepted")
    media_max_video_seconds: float = Field(default=600.0, gt=0, description="longest video accepted (the router "
                                           "decodes every frame up to the last one it samples)")
    log_level: str = Field(default="INFO", description="logging level name")
    hide_internal_errors: bool = Field(default=False, description="5xx answers say only that an error happened "
                                       "(the log keeps the detail under the request id)")

    @field_validator("api_keys", "media_url_allowlist", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return [k.strip() for k in value.split(",") if k.strip()]
        return value

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
