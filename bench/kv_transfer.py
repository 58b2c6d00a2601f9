"""KV transfer bandwidth and latency between two processes, for every available backend.

For each backend (nixl, ucxx both with and without endpoint error handling,
tcp: whichever load here) a target process registers a buffer and this
process READs from it and WRITEs to it: 64 MiB, 1 MiB and 16 KiB, several
iterations each, median GB/s and latency. Next to them, in the same run:

- memcpy: a one-thread torch copy of the same sizes between the same kind of
  buffers in this process, sampled interleaved with the transfers so that
  both see the same machine load (this host is shared and noisy);
- shm copy: the target copies a buffer this process filled through /dev/shm.

Buffers come from `shared.transport.memory.host_buffer` (huge pages); the
`nixl-4k` row repeats NIXL on plain torch memory (4 KiB pages) to show what
they buy. The headline is NIXL's 64 MiB READ (decode pulling from the store)
over memcpy at 64 MiB; target >= 0.70 (`meets_target` asks it of WRITE too).

    python bench/kv_transfer.py [--quick] [--ttft] [--backends nixl nixl-4k ucxx ucxx-eh-off tcp] [--out DIR]

`--ttft` adds the handoff's TTFT comparison (`bench/handoff_ttft.py`) to the same run and result.

Progress goes to stderr; the JSON result is the last line on stdout and is
written to bench/results/kv_transfer-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

import torch

from shared.transport import TransferOp, available_transports, make_transport, unavailable_reason
from shared.transport.memory import host_buffer
from shared.transport.metadata import AgentMetadata

MiB = 1 << 20
SIZES = {"64MiB": 64 * MiB, "1MiB": MiB, "16KiB": 16 << 10}
ITERS = {"quick": {"64MiB": 10, "1MiB": 40, "16KiB": 300}, "full": {"64MiB": 40, "1MiB": 200, "16KiB": 2000}}
TARGET_RATIO = 0.70


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# name -> (transport kind, options, huge pages): ucxx runs both ways (ucxx_backend's docstring has the
# trade-off) and NIXL once more on plain 4 KiB-page torch memory, to show what huge pages buy.
VARIANTS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "nixl": ("nixl", {}, True),
    "nixl-4k": ("nixl", {}, False),
    "ucxx": ("ucxx", {}, True),  # endpoint error handling on (the default): survives dead peers, tcp speed
    "ucxx-eh-off": ("ucxx", {"endpoint_error_handling": False}, True),  # cma speed; a dead peer aborts us
    "tcp": ("tcp", {}, True),
}


def allocate(nbytes: int, huge_pages: bool) -> torch.Tensor:
    return host_buffer(nbytes) if huge_pages else torch.zeros(nbytes, dtype=torch.uint8)


def transport_options(kind: str, extra: dict[str, Any]) -> dict[str, Any]:
    """UCX logs a flush error when a peer has already gone at close; keep stderr for progress."""
    quiet = {"nixl": {"ucx_env": {"UCX_LOG_LEVEL": "fatal"}}, "ucxx": {"ucx_options": {"LOG_LEVEL": "fatal"}}}
    return {"transfer_timeout_s": 20.0, **quiet.get(kind, {}), **extra}


# --- the target process -------------------------------------------------------------------------------


def target_main(kind: str, options: dict[str, Any], huge_pages: bool, shm_name: str,
                conn: Connection) -> None:
    """Register a buffer, hand out metadata, then answer shm-copy timing requests until told to stop."""
    torch.set_num_threads(1)
    nbytes = max(SIZES.values())
    transport = make_transport(kind, "target", **options)
    buf = allocate(nbytes, huge_pages)
    buf.random_(0, 256)
    transport.register(buf)
    conn.send(transport.metadata())
    shm = SharedMemory(shm_name)
    shared = torch.frombuffer(shm.buf, dtype=torch.uint8)
    private = allocate(nbytes, huge_pages)
    while (msg := conn.recv()) is not None:
        size, iters = msg
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            private[:size].copy_(shared[:size])
            samples.append(time.perf_counter() - t0)
        conn.send(samples)
    del shared
    shm.close()
    transport.close()


# --- measurements (this process) ----------------------------------------------------------------------


def time_round(transport: Any, local: Any, remote: Any, size: int, iters: int,
               src: torch.Tensor, dst: torch.Tensor) -> dict[str, list[float]]:
    """Interleave memcpy, READ and WRITE of `size` bytes so that all three see the same machine load."""
    local_descs, remote_descs = [local.descriptor(0, size)], [remote.descriptor(0, size)]

    def transfer(op: TransferOp) -> float:
        t0 = time.perf_counter()
        transport.wait(transport.start(op, local_descs, "target", remote_descs), 30.0)
        return time.perf_counter() - t0

    def memcpy() -> float:
        t0 = time.perf_counter()
        dst[:size].copy_(src[:size])
        return time.perf_counter() - t0

    for _ in range(2):  # warm-up: connection setup, first touch
        transfer(TransferOp.READ)
        transfer(TransferOp.WRITE)
        memcpy()
    samples: dict[str, list[float]] = {"memcpy": [], "read": [], "write": []}
    for _ in range(iters):
        samples["memcpy"].append(memcpy())
        samples["read"].append(transfer(TransferOp.READ))
        samples["write"].append(transfer(TransferOp.WRITE))
    return samples


def summarize(size: int, samples: list[float]) -> dict[str, float]:
    median_s = statistics.median(samples)
    return {"gbps": round(size / median_s / 1e9, 3), "latency_us": round(median_s * 1e6, 1),
            "best_gbps": round(size / min(samples) / 1e9, 3), "iters": len(samples)}


def bench_backend(variant: str, iters: dict[str, int], shm: SharedMemory) -> dict[str, Any]:
    kind, extra, huge_pages = VARIANTS[variant]
    options = transport_options(kind, extra)
    nbytes = max(SIZES.values())
    src, dst = allocate(nbytes, huge_pages), allocate(nbytes, huge_pages)
    src.random_(0, 256)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target_main, args=(kind, options, huge_pages, shm.name, child), daemon=True)
    proc.start()
    transport = make_transport(kind, "initiator", **options)
    try:
        local = transport.register(dst)
        metadata = parent.recv()
        transport.add_remote("target", metadata)
        remote = _only_region(metadata)
        result: dict[str, Any] = {"huge_pages": huge_pages}
        for label, size in SIZES.items():
            n = iters[label]
            parent.send((size, n))
            shm_copy = summarize(size, parent.recv())
            samples = time_round(transport, local, remote, size, n, src, dst)
            memcpy, read, write = (summarize(size, samples[k]) for k in ("memcpy", "read", "write"))
            result[label] = {"read": read, "write": write, "memcpy": memcpy, "shm_copy": shm_copy,
                             "read_vs_memcpy": round(read["gbps"] / memcpy["gbps"], 3),
                             "write_vs_memcpy": round(write["gbps"] / memcpy["gbps"], 3)}
            log(f"  {variant:11s} {label:>6s}: read {read['gbps']:6.2f} GB/s {read['latency_us']:9.1f} us | "
                f"write {write['gbps']:6.2f} GB/s | memcpy {memcpy['gbps']:6.2f} | "
                f"shm copy {shm_copy['gbps']:6.2f}")
        return result
    finally:
        parent.send(None)
        proc.join(30)
        transport.close()


def _only_region(metadata: bytes) -> Any:
    """The target's one registered region, as its metadata advertises it."""
    (region,) = AgentMetadata.decode(metadata).regions
    return region


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer iterations (under a minute)")
    parser.add_argument("--backends", nargs="*", default=None, choices=list(VARIANTS),
                        help="default: every available backend (ucxx both ways)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--ttft", action="store_true",
                        help="also TTFT of a 2,000-token prompt: colocated vs layer-wise vs after-prefill push "
                             "(bench/handoff_ttft.py, SmolLM2 as real services)")
    args = parser.parse_args()
    iters = ITERS["quick" if args.quick else "full"]
    torch.set_num_threads(1)  # memcpy is one thread, like cma's process_vm_readv and the target's copy
    available = available_transports()
    variants = args.backends or [name for name, (kind, *_) in VARIANTS.items() if kind in available]
    skipped = {k: unavailable_reason(k) for k in ("nixl", "ucxx", "tcp") if k not in available}
    nbytes = max(SIZES.values())
    shm = SharedMemory(create=True, size=nbytes)
    torch.frombuffer(shm.buf, dtype=torch.uint8).random_(0, 256)
    t_start = time.perf_counter()
    backends = {}
    try:
        for variant in variants:
            log(f"{variant}: two processes, sizes {', '.join(SIZES)}")
            backends[variant] = bench_backend(variant, iters, shm)
    finally:
        shm.close()
        shm.unlink()
    nixl_64 = backends.get("nixl", {}).get("64MiB")
    nixl_4k_64 = backends.get("nixl-4k", {}).get("64MiB")
    result = {
        "bench": "kv_transfer",
        "mode": "quick" if args.quick else "full",
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(),
                 "memcpy_threads": torch.get_num_threads()},
        "backends": backends,
        "skipped": skipped,
        "nixl_64MiB_read_vs_memcpy": nixl_64["read_vs_memcpy"] if nixl_64 else None,
        "nixl_64MiB_write_vs_memcpy": nixl_64["write_vs_memcpy"] if nixl_64 else None,
        "nixl_4k_pages_64MiB_read_vs_memcpy": nixl_4k_64["read_vs_memcpy"] if nixl_4k_64 else None,
        "target_ratio": TARGET_RATIO,
        "meets_target": bool(nixl_64 and min(nixl_64["read_vs_memcpy"],
                                             nixl_64["write_vs_memcpy"]) >= TARGET_RATIO),
        "elapsed_s": round(time.perf_counter() - t_start, 1),
    }
    if args.ttft:
        import asyncio

        sys.path.insert(0, str(Path(__file__).parent))  # run as a script or with -m
        from handoff_ttft import measure

        log("TTFT of a 2000-token prompt: colocated, layer-wise push, push after prefill")
        torch.set_num_threads(os.cpu_count() or 1)  # the engines compute with every core
        result["ttft"] = asyncio.run(measure("smollm2-135m", 2000, 2 if args.quick else 5, "nixl"
                                             if "nixl" in available else available[0]))
        result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"kv_transfer-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    log(f"wrote {path}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
