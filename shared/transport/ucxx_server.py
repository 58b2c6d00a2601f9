"""The target half of the ucxx transport: answering peers' READ and WRITE requests.

A request's life at the target (all under the agent's lock, driven by `step`)::

    CTRL frame probed ─► received ─► HELLO: endpoint back to the peer
                                 └─► READ/WRITE: check ranges ─► _ServerOp
    _ServerOp: READ  sends DATA(k,i) from registered memory, then REPLY(k)
               WRITE receives DATA(k,i) into registered memory; REPLY(k) once all landed
               rejected: empty DATA (READ) or truncating receives (WRITE), REPLY(k) = error
               past its deadline: the peer's endpoint is closed (cancelling it), then it ends

Also here: loading ucxx without letting it rewrite the process environment,
and the few helpers both halves use.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.transport.base import (
    Descriptor,
    InvalidDescriptorError,
    MemoryRegion,
    TransportError,
    TransportUnavailableError,
)
from shared.transport.regions import RegionTable
from shared.transport.ucxx_wire import (
    CTRL_TAG,
    MAX_CTRL_NBYTES,
    Ctrl,
    CtrlOp,
    data_tag,
    decode_ctrl,
    encode_reply,
    reply_tag,
)

logger = logging.getLogger(__name__)


def ucxx_api() -> Any:
    """ucxx's low-level API module; raises TransportUnavailableError if it cannot load.

    Importing ucxx writes UCX_* defaults meant for its CUDA users into
    os.environ (UCX_RNDV_FRAG_MEM_TYPE=cuda, ...). They are undone here so that
    other UCX users in the process (NIXL) keep their configuration; the
    backend gives its UCX context its settings explicitly instead.
    """
    before = {k: v for k, v in os.environ.items() if k.startswith("UCX")}
    try:
        from ucxx._lib import libucxx
    except Exception as e:  # ImportError, or OSError from libraries that do not load
        raise TransportUnavailableError(f"ucxx is not usable here: {type(e).__name__}: {e}") from e
    finally:
        for key in [k for k in os.environ if k.startswith("UCX") and k not in before]:
            del os.environ[key]
        os.environ.update(before)
    return libucxx


@dataclass(frozen=True)
class Ucx:
    """The ucxx module and the small conveniences both halves of the transport use."""

    lib: Any  # ucxx._lib.libucxx
    array_type: Any  # ucxx._lib.arr.Array

    @classmethod
    def load(cls) -> Ucx:
        lib = ucxx_api()
        from ucxx._lib.arr import Array

        return cls(lib, Array)

    def tag(self, value: int) -> Any:
        return self.lib.UCXXTag(value)

    def array(self, buf: Any) -> Any:
        return self.array_type(buf)

    def host_array(self, desc: Descriptor, keepalive: list[Any]) -> Any:
        """A ucxx Array over registered host memory, without copying it."""
        buf = (ctypes.c_char * desc.nbytes).from_address(desc.addr)
        keepalive.append(buf)
        return self.array_type(buf)

    def first_error(self, requests: Sequence[Any]) -> str | None:
        for req in requests:
            try:
                req.check_error()
            except self.lib.UCXError as e:
                return f"{type(e).__name__}: {e}"
        return None


@dataclass(eq=False)
class _ServerOp:
    """The target's side of one request: its UCX requests, then maybe a reply to send."""

    peer: str
    key: int
    regions: frozenset[MemoryRegion]
    deadline_s: float
    requests: list[Any] = field(default_factory=list)
    keepalive: list[Any] = field(default_factory=list)
    reply_when_done: str | None = None  # WRITE: send this verdict once the receives completed ("" = ok)
    drain: bool = False  # a rejected WRITE, or one cancelled: receive errors are expected


class UcxServer:
    """Serves one agent's registered memory to its peers; every method runs under the agent's lock."""

    def __init__(self, ucx: Ucx, worker: Any, agent: str, timeout_s: float, error_handling: bool,
                 close_endpoint: Callable[[Any], None]) -> None:
        self._ucx = ucx
        self._worker = worker
        self._agent = agent
        self._timeout_s = timeout_s
        self._error_handling = error_handling
        self._close_endpoint = close_endpoint
        self.served = RegionTable()  # swapped whole on (de)registration
        self._reply_eps: dict[str, Any] = {}  # peer name -> endpoint back (from its HELLO)
        self._serving: list[_ServerOp] = []
        self._ctrl_recvs: list[tuple[Any, bytearray]] = []
        self._sends: list[tuple[Any, Any]] = []  # fire-and-forget sends and the bytes they read

    def uses(self, region: MemoryRegion) -> bool:
        return any(region in op.regions for op in self._serving)

    def send_and_forget(self, ep: Any, frame: bytes, tag: int) -> None:
        self._sends.append((ep.tag_send(self._ucx.array(frame), self._ucx.tag(tag)), frame))

    def step(self) -> bool:
        """Take new requests and advance the running ones; True when some request ended."""
        self._accept_ctrl()
        return self._advance()

    def close(self) -> None:
        for ep in self._reply_eps.values():
            self._close_endpoint(ep)
        self._reply_eps.clear()

    def _accept_ctrl(self) -> None:
        lib = self._ucx.lib
        while (probe := self._worker.tag_probe(lib.UCXXTag(CTRL_TAG), lib.UCXXTagMaskFull, True)).matched:
            buf = bytearray(min(probe.length, MAX_CTRL_NBYTES))  # an oversized frame truncates and is dropped
            self._ctrl_recvs.append((self._worker.tag_recv_with_handle(self._ucx.array(buf), probe), buf))
        pending = []
        for req, buf in self._ctrl_recvs:
            if not req.completed:
                pending.append((req, buf))
                continue
            try:
                req.check_error()
                self._handle(decode_ctrl(bytes(buf)))
            except (lib.UCXError, TransportError) as e:
                logger.warning("agent %s: dropped a control frame: %s", self._agent, e)
        self._ctrl_recvs = pending

    def _handle(self, ctrl: Ctrl) -> None:
        if ctrl.op is CtrlOp.HELLO:
            self._close_endpoint(self._reply_eps.pop(ctrl.sender, None))
            address = self._ucx.lib.UCXAddress.create_from_buffer(ctrl.address)
            self._reply_eps[ctrl.sender] = self._ucx.lib.UCXEndpoint.create_from_worker_address(
                self._worker, address, self._error_handling)
            return
        ep = self._reply_eps.get(ctrl.sender)
        if ep is None:
            raise TransportError(f"request from {ctrl.sender!r}, which never said hello")
        error, regions = self._check(ctrl.descs)
        op = _ServerOp(ctrl.sender, ctrl.key, regions, time.monotonic() + self._timeout_s)
        ucx = self._ucx
        if ctrl.op is CtrlOp.READ:
            empty = bytearray(0)  # completes the initiator's posted receive without touching its memory
            op.keepalive.append(empty)
            for i, desc in enumerate(ctrl.descs):
                data = ucx.array(empty) if error else ucx.host_array(desc, op.keepalive)
                op.requests.append(ep.tag_send(data, ucx.tag(data_tag(ctrl.key, i))))
            reply = encode_reply(error)
            op.keepalive.append(reply)
            op.requests.append(ep.tag_send(ucx.array(reply), ucx.tag(reply_tag(ctrl.key))))
        else:
            op.drain, op.reply_when_done = error is not None, error or ""
            scratch = bytearray(1)  # a rejected WRITE's data truncates into this and is dropped
            op.keepalive.append(scratch)
            for i, desc in enumerate(ctrl.descs):
                data = ucx.array(scratch) if error else ucx.host_array(desc, op.keepalive)
                op.requests.append(ep.tag_recv(data, ucx.tag(data_tag(ctrl.key, i))))
        self._serving.append(op)

    def _check(self, descs: Sequence[Descriptor]) -> tuple[str | None, frozenset[MemoryRegion]]:
        try:
            return None, frozenset(self.served.find(d) for d in descs)
        except InvalidDescriptorError as e:
            return f"target rejected the request: {e.message}", frozenset()

    def _advance(self) -> bool:
        now, pending = time.monotonic(), []
        for op in self._serving:
            if all(r.completed for r in op.requests):
                error = None if op.drain else self._ucx.first_error(op.requests)
                if op.reply_when_done is not None:
                    ep = self._reply_eps.get(op.peer)
                    if ep is not None:
                        self.send_and_forget(ep, encode_reply(error or op.reply_when_done or None),
                                             reply_tag(op.key))
                elif error is not None:
                    logger.warning("agent %s: serving %s failed: %s", self._agent, op.peer, error)
            elif now > op.deadline_s:
                logger.warning("agent %s: request from %s timed out; closing its endpoint", self._agent,
                               op.peer)
                self._close_endpoint(self._reply_eps.pop(op.peer, None))  # cancels its requests
                op.deadline_s, op.drain, op.reply_when_done = float("inf"), True, None
                pending.append(op)
            else:
                pending.append(op)
        self._sends = [(req, data) for req, data in self._sends if not req.completed]
        ended = len(pending) != len(self._serving)
        self._serving = pending
        return ended
