"""The target side of the two-process transport tests: one agent in its own (spawned) process.

The test process is the initiator; the peer registers a KV cache in the shared
layout (seeded, so both sides know its bytes) and answers a few commands over
a pipe so that the test can look at its memory::

    peer ──► {"metadata", "kv_addr", "big_addr", "hidden": (addr, nbytes)}   once, at start
    test ──► ("bytes", [(addr, nbytes), ...])  ─► the bytes there, concatenated
    test ──► None                              ─► close the transport and exit
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from shared.kv.layout import KVLayout
from shared.transport import make_transport

# 4 layers x 16 blocks of 16 tokens x 2 KV heads x 32 dims in fp16: 4 KiB per (layer, block).
LAYOUT = KVLayout(num_layers=4, num_blocks=16, block_size=16, num_kv_heads=2, head_dim=32,
                  dtype=torch.float16)
BIG_NBYTES = 64 << 20
STARTUP_TIMEOUT_S = 60.0


def seeded_kv(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.shape, generator=gen).to(LAYOUT.dtype)  # [layers, blocks, 2, block, heads, dim]


def peer_main(kind: str, name: str, options: dict[str, Any], big: bool, conn: Connection) -> None:
    transport = make_transport(kind, name, **options)
    kv = seeded_kv(seed=1)
    transport.register(kv)
    big_buf = torch.full((BIG_NBYTES,), 7, dtype=torch.uint8) if big else None
    if big_buf is not None:
        transport.register(big_buf)
    hidden = torch.full((1 << 16,), 3, dtype=torch.uint8)  # memory the peer never registers
    conn.send({
        "metadata": transport.metadata(), "kv_addr": kv.data_ptr(),
        "big_addr": None if big_buf is None else big_buf.data_ptr(),
        "hidden": (hidden.data_ptr(), hidden.numel()),
    })
    while (cmd := conn.recv()) is not None:
        _, spans = cmd
        conn.send(b"".join(ctypes.string_at(addr, nbytes) for addr, nbytes in spans))
    transport.close()


@dataclass
class Peer:
    """The test's handle on a peer process."""

    proc: BaseProcess
    conn: Connection
    info: dict[str, Any]

    @property
    def metadata(self) -> bytes:
        return bytes(self.info["metadata"])

    def read_bytes(self, spans: list[tuple[int, int]]) -> bytes:
        self.conn.send(("bytes", spans))
        data: bytes = self.conn.recv()
        return data

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


def start_peers(kind: str, options: dict[str, Any], specs: list[tuple[str, bool]]) -> list[Peer]:
    """Spawn one peer per (name, with_big_buffer), all at once (their imports overlap), and wait for each."""
    ctx = mp.get_context("spawn")
    started = []
    for name, big in specs:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=peer_main, args=(kind, name, options, big, child), daemon=True)
        proc.start()
        started.append((proc, parent))
    peers = []
    for proc, parent in started:
        if not parent.poll(STARTUP_TIMEOUT_S):
            proc.kill()
            raise TimeoutError(f"{kind} peer did not start within {STARTUP_TIMEOUT_S:g} s")
        peers.append(Peer(proc, parent, parent.recv()))
    return peers
