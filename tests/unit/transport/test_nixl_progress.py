"""NIXL's passive progress runs at full rate only while traffic is expected (shared/transport/nixl_backend.py).

Over UCX's tcp transport a target's worker must be progressed for a peer's READ or WRITE to complete; an
idle agent polls rarely, and `expect_traffic()` (kv_transfer calls it when a handoff is reserved or claimed)
brings the full rate back at once.
"""

from __future__ import annotations

import time

import pytest
import torch

from shared.transport import TransferOp, make_transport, nixl_backend


def _quiet(monkeypatch: pytest.MonkeyPatch, window_s: float) -> None:
    monkeypatch.setattr(nixl_backend, "ACTIVE_WINDOW_S", window_s)


def test_an_idle_agent_stops_polling_and_expect_traffic_wakes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    _quiet(monkeypatch, 0.2)
    agent = make_transport("nixl", "idle", passive_idle_interval_s=30.0)
    try:
        deadline = time.monotonic() + 5.0
        while time.monotonic() < agent._active_until + 0.1 and time.monotonic() < deadline:  # type: ignore[attr-defined]
            time.sleep(0.05)
        time.sleep(0.1)  # the loop is now in its 30 s idle wait
        idle_from = agent.num_progress_calls  # type: ignore[attr-defined]
        time.sleep(0.3)
        assert agent.num_progress_calls == idle_from  # type: ignore[attr-defined]
        agent.expect_traffic()
        for _ in range(100):
            if agent.num_progress_calls > idle_from + 3:  # type: ignore[attr-defined]
                break
            time.sleep(0.02)
        assert agent.num_progress_calls > idle_from + 3  # type: ignore[attr-defined]
    finally:
        agent.close()


def test_a_read_over_tcp_from_a_target_told_to_expect_it_completes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kv_transfer pattern: the target hears of the read on the control path, then the peer reads."""
    _quiet(monkeypatch, 0.2)
    options = {"ucx_tls": "tcp,self", "transfer_timeout_s": 10.0, "passive_idle_interval_s": 30.0,
               "ucx_env": {"UCX_LOG_LEVEL": "fatal"}}
    target = make_transport("nixl", "target", **options)
    reader = make_transport("nixl", "reader", **options)
    try:
        src = torch.arange(1 << 16, dtype=torch.int32)
        dst = torch.zeros_like(src)
        region_src, region_dst = target.register(src), reader.register(dst)
        reader.add_remote("target", target.metadata())
        time.sleep(0.5)  # both agents' windows expire: the target now polls every 30 s
        target.expect_traffic()  # what kv_transfer's Claim does
        nbytes = src.numel() * src.element_size()
        handle = reader.start(TransferOp.READ, [region_dst.descriptor(0, nbytes)], "target",
                              [region_src.descriptor(0, nbytes)])
        reader.wait(handle, 10.0)
        assert torch.equal(dst, src)
    finally:
        reader.close()
        target.close()


def test_an_agent_polls_at_full_rate_while_its_probe_says_data_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    _quiet(monkeypatch, 0.2)
    agent = make_transport("nixl", "watched", passive_idle_interval_s=30.0)
    moving = True
    agent.watch_traffic(lambda: moving)
    try:
        time.sleep(0.6)  # the window since creation is over; the probe keeps the full rate
        before = agent.num_progress_calls  # type: ignore[attr-defined]
        time.sleep(0.3)
        assert agent.num_progress_calls > before + 3  # type: ignore[attr-defined]
        moving = False
        time.sleep(0.1)  # the next poll sees the probe false and waits 30 s
        quiet_from = agent.num_progress_calls  # type: ignore[attr-defined]
        time.sleep(0.3)
        assert agent.num_progress_calls == quiet_from  # type: ignore[attr-defined]
    finally:
        agent.close()
