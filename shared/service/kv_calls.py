"""kv_transfer's control calls for an engine thread (shared/engine/kv_spill.py's KVTransferCalls).

The engine thread may not touch the service's event loop; each call here is handed to that loop
(`run_coroutine_threadsafe`) and waited for up to a deadline, while the loop goes on serving. The servicer
tells it which gRPC address each kv_transfer agent it claims from answers at (`learn`), since a request
names its kv_transfer only on the control path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import Any, TypeVar

from shared.errors import KVTransferError
from shared.kv.remote import AgentAddress, HandoffResult, HandoffSlots, HandoffSpec
from shared.service.kv_client import KVTransferClient

T = TypeVar("T")


class EngineKVCalls:
    def __init__(self, kv: KVTransferClient, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self._kv = kv
        self._loop = loop
        self._timeout_s = timeout_s
        self._addresses: dict[str, str] = {}  # agent name -> gRPC address (written on the loop, read anywhere)

    def learn(self, agent: AgentAddress, address: str) -> None:
        self._addresses[agent.space.agent_name] = address

    def address_of(self, agent_name: str) -> str | None:
        return self._addresses.get(agent_name)

    def reserve(self, address: str, spec: HandoffSpec) -> tuple[HandoffSlots, AgentAddress]:
        return self._run(self._kv.reserve(address, spec))

    def commit(self, address: str, handoff_id: str, result: HandoffResult, capability: str) -> None:
        self._run(self._kv.commit(address, handoff_id, result, capability))

    def release(self, address: str, handoff_id: str, failed: bool, capability: str) -> None:
        """The engine releases a lease after its own transfers on it are over or stopped (kv_spill.py)."""
        self._run(self._kv.release(address, handoff_id, failed=failed, capability=capability, transfers_stopped=True))

    def _run(self, call: Coroutine[Any, Any, T]) -> T:
        try:
            future = asyncio.run_coroutine_threadsafe(call, self._loop)
        except RuntimeError as err:  # the loop is closed: the service is stopping
            call.close()
            raise KVTransferError(f"kv_transfer call not made: {err}") from err
        try:
            return future.result(self._timeout_s)
        except concurrent.futures.TimeoutError as err:
            future.cancel()
            raise KVTransferError(f"kv_transfer call took longer than {self._timeout_s:.0f} s") from err
