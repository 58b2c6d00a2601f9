"""Factories for registry tests: an `InstanceInfo` with only the fields a test cares about."""

from __future__ import annotations

from shared.registry import InstanceInfo, Load


def make_instance(
    instance_id: str,
    service: str = "decode",
    *,
    load: Load | None = None,
    draining: bool = False,
    model: str = "smollm2-135m",
) -> InstanceInfo:
    port = 50000 + sum(instance_id.encode()) % 10000
    return InstanceInfo(
        service=service,
        instance_id=instance_id,
        address=f"127.0.0.1:{port}",
        metrics_url=f"http://127.0.0.1:{port + 1}/metrics",
        model=model,
        load=load if load is not None else Load(),
        started_at=1_700_000_000.0,
        draining=draining,
    )


def decode_load(free: int, total: int = 100, running: int = 0, waiting: int = 0) -> Load:
    return Load(num_running=running, num_waiting=waiting, num_kv_blocks_total=total, num_kv_blocks_free=free)
