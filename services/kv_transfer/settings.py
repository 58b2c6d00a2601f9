"""Settings of the kv_transfer service: environment variables `BATON_KV_TRANSFER_<FIELD>`.

For example `BATON_KV_TRANSFER_PORT=50053`, `BATON_KV_TRANSFER_TRANSPORT=nixl`.
Parsed once, in `services.kv_transfer.main`.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.grpc_common import DEFAULT_MAX_MESSAGE_BYTES


class KVTransferSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BATON_KV_TRANSFER_", extra="ignore", frozen=True)

    host: str = Field(default="127.0.0.1", description="interface the gRPC server binds")
    port: int = Field(default=50053, ge=0, le=65535, description="gRPC port; 0 = let the OS pick")
    tls_dir: Path | None = Field(default=None, description="mutual TLS on every internal gRPC call: a directory "
                                 "with ca.pem and this service's <service>.pem and <service>-key.pem "
                                 "(`baton certs` makes a set); unset = plaintext")
    internal_token: str = Field(default="", repr=False, description="shared token every internal gRPC call "
                                "carries and every server requires (health checks excepted); empty = open")
    capacity_bytes: int = Field(
        default=2 << 30,
        ge=0,
        description="host memory of the slot slab; a Reserve that does not fit is refused (backpressure)",
    )
    prefault_ahead_bytes: int = Field(
        default=0, ge=0,
        description="slab memory faulted in ahead of the slots handed out, on a thread at idle priority "
                    "(shared/transport/prefault.py): otherwise a prefill's first write into a fresh slot zeroes "
                    "its huge pages inside the transfer (e.g. 268435456); 0 = off, the default until it shows a "
                    "TTFT gain beyond noise (it moved ~26 ms of zeroing a handoff out of the prefill process)",
    )
    encoder_cache_bytes: int = Field(
        default=256 << 20, ge=0,
        description="memory for encoder outputs (images' and audio's soft tokens) shared by the prefill "
                    "instances, least recently used out first; 0 = keep none",
    )
    slot_nbytes: int = Field(
        default=0, ge=0, description="bytes per slot (one KV block of every layer); 0 = sized by the first Reserve"
    )
    eviction_policy: str = Field(
        default="lru", pattern="^(lru|lfu)$",
        description="which unpinned prefix-pool block goes when slots run out: lru (least recently released) "
                    "or lfu (least frequently hit, aged; services/kv_transfer/slots.py)",
    )
    transport: str = Field(
        default="auto", pattern="^(auto|nixl|ucxx|tcp)$",
        description="data-path transport; auto = the first of nixl, ucxx, tcp that works here",
    )
    claim_timeout_s: float = Field(
        default=30.0, gt=0, description="how long decode may take to pull a claimed handoff before it expires"
    )
    lease_timeout_s: float = Field(
        default=30.0, gt=0, description="how long an unclaimed handoff is kept when its Reserve does not say"
    )
    max_lease_timeout_s: float = Field(
        default=600.0, gt=0, description="upper bound on a Reserve's own lease timeout"
    )
    max_claim_wait_s: float = Field(default=60.0, ge=0, description="upper bound on a Claim's wait_ms")
    sweep_interval_s: float = Field(
        default=0.25, gt=0, le=60, description="how often expired leases are freed"
    )
    metrics_port: int = Field(
        default=9403, ge=-1, le=65535, description="Prometheus /metrics port, on `host`; 0 = any, -1 = off"
    )
    max_message_bytes: int = Field(
        default=DEFAULT_MAX_MESSAGE_BYTES, ge=4 << 20, description="largest gRPC message"
    )
    shutdown_grace_s: float = Field(default=5.0, ge=0, description="time calls in flight get on shutdown")
    log_level: str = Field(default="INFO", description="logging level name")
    redis_url: str = Field(default="", description="registry; empty = no registration")
    registry_namespace: str = Field(default="baton", description="registry key namespace")
    heartbeat_ttl_s: float = Field(default=6.0, gt=0, description="registry entry lifetime without a beat")
    instance_id: str = Field(default="", description="registry id; default: kv_transfer-hostname-random")
    advertise_host: str = Field(default="", description="host others reach us at; default: `host`")
    port_file: Path | None = Field(default=None, description="file the bound gRPC port is written to once "
                                   "serving: a health check's way to it when port is 0 (host networking)")

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"
