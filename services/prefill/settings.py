"""Settings of the prefill service: environment variables `BATON_PREFILL_<FIELD>`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.service.settings import EngineServiceSettings


class PrefillSettings(EngineServiceSettings):
    model_config = SettingsConfigDict(env_prefix="BATON_PREFILL_", extra="ignore", frozen=True)

    port: int = Field(default=50051, ge=0, le=65535, description="gRPC port; 0 = let the OS pick")
    metrics_port: int = Field(default=9401, ge=-1, le=65535, description="Prometheus port; 0 = any, -1 = off")
    kv_push_mode: Literal["layerwise", "after_prefill"] = Field(
        default="layerwise",
        description="layerwise: each layer's KV is sent as soon as it is computed; after_prefill: all at the end",
    )
    kv_hidden_states: bool = Field(default=True, description="send the prompt's hidden states (a draft head's input)")
    share_encoder_outputs: bool = Field(
        default=True, description="take images' and audio's encoder outputs from kv_transfer's shared cache "
                                  "when it holds them, and offer it the ones this instance encodes")
