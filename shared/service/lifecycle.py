"""Running a service until SIGTERM/SIGINT, then stopping it once."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from shared.grpc_tls import configure_internal_auth
from shared.telemetry import setup_tracing

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class ProcessSettings(Protocol):
    internal_token: str
    tls_dir: Path | None
    log_level: str


def set_up_process(service: str, settings: ProcessSettings) -> None:
    """What a service's `main` does before it serves: the internal token and mutual TLS (`service` names its
    certificate), the log format, tracing (as baton-<service>)."""
    configure_internal_auth(settings.internal_token, settings.tls_dir, service)
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT)
    setup_tracing("baton-" + service.replace("_", "-"))


EVENT_LOOPS = ("uvloop", "asyncio")


def run(main: Coroutine[Any, Any, None]) -> None:
    """A service's `main` coroutine to its end on its event loop: uvloop (uvicorn[standard] installs it) unless
    BATON_EVENT_LOOP=asyncio. Every streamed token is a few wake-ups of the router's and the engine
    service's loops (a gRPC message each way, an SSE chunk), on the cores the model computes on, where each
    millisecond stalls a decode step. On uvloop gRPC's asyncio API spent about 100-125 us of CPU a message
    against 150-240 on asyncio's own loop (a server streaming to a client every 5 ms); in a colocated stack
    streaming 8 x 5 x 128 tokens (Zen 5, 2 cores, int8), three runs each way, the engine service's event
    loop thread took 0.29-0.36 CPU-s against 0.39-0.51 and the router 0.66-0.78 against 0.72-0.88
    (2026-11-29)."""
    choice = os.environ.get("BATON_EVENT_LOOP", "uvloop")
    if choice not in EVENT_LOOPS:
        raise ValueError(f"BATON_EVENT_LOOP must be one of {EVENT_LOOPS}, got {choice!r}")
    if choice == "uvloop":
        try:
            import uvloop
        except ImportError:
            logger.warning("uvloop is not installed: running on asyncio's event loop")
        else:
            uvloop.run(main)
            return
    asyncio.run(main)


class Stoppable(Protocol):
    async def stop(self) -> None: ...


_WATCH_INTERVAL_S = 1.0


async def run_until_signal(start: Callable[[], Awaitable[Stoppable]], stop: asyncio.Event | None = None) -> None:
    """Start a service, wait for SIGTERM/SIGINT (or `stop`), then stop it.

    A service that can fail on its own (`failure()`: an engine thread that died) is watched: when it
    fails, it is stopped and the process exits 1, so its supervisor (`baton up`, Kubernetes) restarts it
    instead of leaving a registered instance that answers every request with an error.
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
    running = await start()
    failed: list[str] = []
    watch = every(_WATCH_INTERVAL_S, lambda: _check_failure(running, failed, stop), "failure-watch")
    try:
        await stop.wait()
    finally:
        watch.cancel()
        await running.stop()
        for sig in handled:
            loop.remove_signal_handler(sig)
    if failed:
        raise SystemExit(1)


def _check_failure(running: Stoppable, failed: list[str], stop: asyncio.Event) -> None:
    failure = getattr(running, "failure", lambda: None)()
    if failure and not failed:
        logger.error("service failed (%s): stopping, exit 1", failure)
        failed.append(failure)
        stop.set()


def write_port_file(path: Path | None, port: int) -> None:
    """Leave the port a service bound (the OS's pick when asked for 0) where its health check reads it;
    written whole (a rename), so a reader never sees half a number."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{port}\n")
    tmp.replace(path)


def every(interval_s: float, fn: Callable[[], Awaitable[object] | object], name: str) -> asyncio.Task[None]:
    """A background task calling `fn` (sync or async) every `interval_s`; cancel it to stop."""

    async def run() -> None:
        while True:
            await asyncio.sleep(interval_s)
            result = fn()
            if inspect.isawaitable(result):
                await result

    return asyncio.create_task(run(), name=name)


async def cancel(task: asyncio.Task[None] | None) -> None:
    """Cancel a background task and wait until it has stopped."""
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class MetricsHTTP:
    """A Prometheus /metrics endpoint on its own thread, for one registry."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry) -> None:
        self._httpd: WSGIServer
        self._thread: threading.Thread
        self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
