"""The engine's end of the KV data path: its transport agents, and groups of transfers it polls.

An engine makes one agent per transport kind on first use (the kind is
whatever the kv_transfer instance speaks), registers its whole KV cache with
it once, and adds each kv_transfer agent it meets as a remote::

    KVAgents.link(address) ─► Link(transport, cache region, remote name)
    TransferGroup(link): start(op, plan) ... poll() ─► PENDING | DONE | FAILED;  abort() stops them all

Everything here runs on the engine thread (a transport is driven by one thread).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import torch

from shared.kv.remote import AgentAddress, TransferPlan
from shared.transport import Transport
from shared.transport.base import (
    MemoryRegion,
    TransferFailedError,
    TransferHandle,
    TransferOp,
    TransferState,
    TransportError,
)
from shared.transport.factory import service_transport

logger = logging.getLogger(__name__)


@dataclass
class Link:
    """A route from this engine's cache to one kv_transfer agent."""

    transport: Transport
    cache_region: MemoryRegion
    remote_name: str


class KVAgents:
    """This engine's transport agents, one per kind, each with the KV cache registered."""

    def __init__(self, role: str, kv_cache: torch.Tensor, *, host: str = "127.0.0.1",
                 transfer_timeout_s: float = 30.0) -> None:
        self._name = f"{role}-{uuid.uuid4().hex[:12]}"
        self._kv_cache = kv_cache  # [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
        self._host = host
        self._transfer_timeout_s = transfer_timeout_s
        self._agents: dict[str, tuple[Transport, MemoryRegion]] = {}
        self._remotes: dict[tuple[str, str], bytes] = {}  # (kind, remote name) -> metadata added

    def link(self, address: AgentAddress) -> Link:
        """The link to `address`'s agent: made (and the remote added) on first use."""
        transport, region = self._agent(address.kind)
        key = (address.kind, address.space.agent_name)
        if self._remotes.get(key) != address.metadata:
            transport.add_remote(address.space.agent_name, address.metadata)
            self._remotes[key] = address.metadata
        return Link(transport, region, address.space.agent_name)

    def _agent(self, kind: str) -> tuple[Transport, MemoryRegion]:
        if kind not in self._agents:
            started = time.perf_counter()
            transport = service_transport(kind, f"{self._name}-{kind}", host=self._host,
                                          transfer_timeout_s=self._transfer_timeout_s)
            try:
                region = transport.register(self._kv_cache)
            except BaseException:
                transport.close()
                raise
            self._agents[kind] = (transport, region)
            logger.info("%s agent %s ready, KV cache registered (%.0f MiB) in %.2f s", kind, transport.name,
                        region.nbytes / 2**20, time.perf_counter() - started)
        return self._agents[kind]

    def forget(self, address: AgentAddress) -> None:
        """Drop a remote (its agent restarted): the next link re-adds it."""
        key = (address.kind, address.space.agent_name)
        if self._remotes.pop(key, None) is not None:
            transport, _ = self._agents[address.kind]
            try:
                transport.remove_remote(address.space.agent_name)
            except TransportError:
                pass

    def close(self) -> None:
        for transport, _ in self._agents.values():
            transport.close()
        self._agents.clear()
        self._remotes.clear()


@dataclass
class TransferGroup:
    """Transfers of one request over one link, polled together; FAILED as soon as one fails."""

    link: Link
    handles: list[TransferHandle] = field(default_factory=list)
    error: str | None = None
    nbytes: int = 0
    started_s: float = field(default_factory=time.perf_counter)
    _temp_regions: list[MemoryRegion] = field(default_factory=list)

    def register(self, memory: torch.Tensor) -> MemoryRegion:
        """Register a staging buffer for the life of this group."""
        region = self.link.transport.register(memory)
        self._temp_regions.append(region)
        return region

    def start(self, op: TransferOp, plan: TransferPlan) -> None:
        if not len(plan) or self.error is not None:
            return
        try:
            handle = self.link.transport.start(op, plan.local, self.link.remote_name, plan.remote)
        except TransportError as e:
            self.error = f"{type(e).__name__}: {e}"
            return
        self.handles.append(handle)
        self.nbytes += plan.nbytes
        if handle.state is TransferState.FAILED:  # a transport may fail a transfer as it posts it
            self.error = handle.error or "transfer failed"

    def poll(self) -> TransferState:
        if self.error is not None:
            return TransferState.FAILED
        pending = False
        for handle in self.handles:
            # a handle that ended is checked too: one that failed as it was posted, or in another poll, must
            # fail the group (counting it as done once let a pull whose reads never ran serve its blocks)
            state = handle.state if handle.done else self.link.transport.poll(handle)
            if state is TransferState.FAILED:
                self.error = handle.error or "transfer failed"
                return TransferState.FAILED
            pending |= state is TransferState.PENDING
        return TransferState.PENDING if pending else TransferState.DONE

    def abort(self) -> None:
        """Stop every transfer still in flight: afterwards none touches local memory."""
        for handle in self.handles:
            if not handle.done:
                try:
                    self.link.transport.wait(handle, 0.0)  # aborts what is still pending
                except TransferFailedError:
                    pass

    def restart(self) -> None:
        """Abort and forget the transfers so far (their source blocks are gone); the group starts over."""
        self.abort()
        self.handles.clear()
        self.nbytes = 0

    def close(self) -> None:
        """Abort and drop the staging registrations (call exactly once, when the group is over)."""
        self.abort()
        for region in self._temp_regions:
            try:
                self.link.transport.deregister(region)
            except TransportError:
                logger.warning("deregistering a staging buffer failed", exc_info=True)
        self._temp_regions.clear()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started_s


class _Job(Protocol):
    group: TransferGroup


JobT = TypeVar("JobT", bound=_Job)


class RequestTransfers(Generic[JobT]):
    """Transfer jobs by request id (the pusher's and the puller's), each with its TransferGroup."""

    def __init__(self) -> None:
        self._jobs: dict[str, JobT] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._jobs

    @property
    def num_jobs(self) -> int:
        return len(self._jobs)

    def abort(self, request_id: str) -> None:
        """Stop the request's transfers (before its blocks are freed). Idempotent."""
        job = self._jobs.pop(request_id, None)
        if job is not None:
            job.group.close()

    def abort_all(self) -> None:
        for request_id in list(self._jobs):
            self.abort(request_id)
