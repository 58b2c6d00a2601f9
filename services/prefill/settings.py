"""Settings of the prefill service: environment variables `BATON_PREFILL_<FIELD>`."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.service.settings import EngineServiceSettings


class PrefillSettings(EngineServiceSettings):
    model_config = SettingsConfigDict(env_prefix="BATON_PREFILL_", extra="ignore", frozen=True)

    port: int = Field(default=50051, ge=0, le=65535, description="gRPC port; 0 = let the OS pick")
    metrics_port: int = Field(default=9401, ge=-1, le=65535, description="Prometheus port; 0 = any, -1 = off")
    kv_push_timeout_s: float = Field(default=30.0, gt=0, description="deadline of one handoff Put")
