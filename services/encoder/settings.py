"""Settings of the encoder service: environment variables `BATON_ENCODER_<FIELD>`.

It shares the engine services' settings (model, device, dtype, registry, TLS, ...): its towers must be
loaded as a prefill engine of the same model loads them, or their outputs would not match its key.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.service.settings import EngineServiceSettings


class EncoderSettings(EngineServiceSettings):
    model_config = SettingsConfigDict(env_prefix="BATON_ENCODER_", extra="ignore", frozen=True)

    port: int = Field(default=50054, ge=0, le=65535, description="gRPC port; 0 = let the OS pick")
    metrics_port: int = Field(default=9404, ge=-1, le=65535, description="Prometheus port; 0 = any, -1 = off")
    max_batch_items: int = Field(default=32, ge=1, description="media items one tower pass takes at most")
    cache_items: int = Field(default=64, ge=0, description="encoder outputs kept in this process (LRU)")
