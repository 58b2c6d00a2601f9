"""Settings of the decode service: environment variables `BATON_DECODE_<FIELD>`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.service.settings import EngineServiceSettings


class DecodeSettings(EngineServiceSettings):
    model_config = SettingsConfigDict(env_prefix="BATON_DECODE_", extra="ignore", frozen=True)

    port: int = Field(default=50052, ge=0, le=65535, description="gRPC port; 0 = let the OS pick")
    metrics_port: int = Field(default=9402, ge=-1, le=65535, description="Prometheus port; 0 = any, -1 = off")
    role: Literal["decode", "colocated"] = Field(
        default="decode", description="decode: continue handed-off requests; colocated: also prefill itself"
    )
    kv_claim_wait_s: float = Field(default=10.0, ge=0, description="how long a Claim waits for prefill's Commit")
    kv_spill: bool = Field(default=False, description="decode role: park a preempted request's context in the "
                           "kv_transfer pool its KV came through and read it back when it resumes, instead of "
                           "computing it again (shared/engine/kv_spill.py)")
    kv_spill_call_timeout_s: float = Field(default=5.0, gt=0, description="how long the engine waits for one of "
                                           "kv_transfer's control calls while it parks or reads back a context")
