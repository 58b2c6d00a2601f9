"""Start and stop a throwaway, in-memory `redis-server` on 127.0.0.1 for tests.

proc, url = start_redis()          # free port, no persistence
...
stop_redis(proc)
proc, url = start_redis(port)      # a "restart" on the same port (empty again)
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

from shared.service.ports import unused_port

REDIS_SERVER = "redis-server"
INSTALL_HINT = "install it with `apt-get install -y redis-server` (`make test` does this: system-deps)"


def redis_server_path() -> str | None:
    """Path of the redis-server binary, or None when it is not installed."""
    return shutil.which(REDIS_SERVER)


def free_port() -> int:
    """A port for a server a test starts (below the ephemeral range: shared/service/ports.py)."""
    return unused_port("127.0.0.1")


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_redis(
    port: int | None = None, *, startup_timeout_s: float = 5.0
) -> tuple[subprocess.Popen[bytes], str]:
    """Start `redis-server` on 127.0.0.1 (`port`, or a free one) with persistence off; return the
    process and its URL once it answers PING. Raises RuntimeError if it is missing or does not come up."""
    binary = redis_server_path()
    if binary is None:
        raise RuntimeError(f"{REDIS_SERVER} not found on PATH; {INSTALL_HINT}")
    port = free_port() if port is None else port
    log = tempfile.TemporaryFile()
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    args += ["--dir", tempfile.gettempdir()]
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + startup_timeout_s
    while not _answers_ping(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_redis(proc)
            log.seek(0)
            output = log.read().decode(errors="replace")[-2000:]
            raise RuntimeError(
                f"{REDIS_SERVER} on port {port} did not come up (rc={proc.returncode}):\n{output}"
            )
        time.sleep(0.02)
    log.close()  # redis keeps its own handle; the file vanishes when redis exits
    return proc, f"redis://127.0.0.1:{port}/0"


def stop_redis(proc: subprocess.Popen[bytes], *, kill: bool = False) -> None:
    """Stop the server (SIGTERM, or SIGKILL with `kill=True`) and reap it."""
    if proc.poll() is not None:
        return
    if kill:
        proc.kill()
    else:
        proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
