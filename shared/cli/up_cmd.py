"""`baton up`: the whole stack as local processes on 127.0.0.1.

    baton up ─┬─ kv_transfer          (disagg)
              ├─ prefill × N          (disagg)
              ├─ encoder × E          (disagg, --encoder E: media towers apart from prefill)
              ├─ decode × M           (role decode; role colocated in --mode colocated)
              └─ router :PORT         (OpenAI HTTP)
    waits for every health check ─► "baton ready: http://127.0.0.1:PORT/v1"
    writes .baton/stack.json; Ctrl-C / SIGTERM stops everything it started.

Ports are checked free before anything starts, and a child that fails is restarted
a bounded number of times (see supervisor.py).

Services find each other through Redis when `--redis-url` is given; otherwise
the router keeps an in-process registry fed by polling the addresses given here.
Each child is configured only through its `BATON_<SERVICE>_*` environment.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shared.cache_dir import DEFAULT_CACHE_DIR
from shared.cli.supervisor import RestartPolicy, SupervisedChild, Supervisor, check_ports_free
from shared.engine.precision import DTYPE_CHOICES, KV_CACHE_DTYPE_CHOICES, resolve_precision
from shared.errors import ConfigError, UnavailableError
from shared.grpc_tls import set_tls
from shared.models.loader import check_checkpoint
from shared.models.weight_format import QUANTIZATIONS
from shared.service.ports import unused_port
from shared.tls_certs import CERT_SERVICES, make_dev_certs

HOST = "127.0.0.1"


@dataclass
class Child:
    name: str
    service: str  # kv_transfer | prefill | decode | colocated | encoder | router
    address: str
    metrics_url: str
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    instance_id: str = ""  # the router's: its /health names it, so an answer from another stack is not taken

    def exit_code(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None


@dataclass
class Stack:
    children: list[Child] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return {"services": [
            {"name": c.name, "service": c.service, "pid": c.proc.pid if c.proc else None, "address": c.address,
             "metrics_url": c.metrics_url, "log": str(c.log_path) if c.log_path else None}
            for c in self.children
        ]}


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("up", help="start the whole stack locally (router, prefill, kv_transfer, decode)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prefill", type=int, default=1, help="prefill instances (disagg)")
    p.add_argument("--decode", type=int, default=1, help="decode instances")
    p.add_argument("--encoder", type=int, default=0,
                   help="encoder instances (disagg, a model that reads images or audio): media encoded apart "
                        "from the prefills, outputs through kv_transfer")
    p.add_argument("--mode", choices=["disagg", "colocated"], default="disagg")
    p.add_argument("--spec", choices=["none", "ngram", "draft", "eagle", "gemma4_assistant"], default="none",
                   help="speculative decoding in decode (eagle needs --spec-eagle-head, gemma4_assistant "
                        "--spec-draft-model)")
    p.add_argument("--spec-draft-model", default=None,
                   help="draft: a model sharing the tokenizer; gemma4_assistant: the assistant's HF directory")
    p.add_argument("--num-speculative-tokens", type=int, default=3, help="draft tokens verified per step")
    p.add_argument("--spec-eagle-head", type=Path, default=None, help="head saved by `baton train-draft`")
    p.add_argument("--spec-disable-batch-size", type=int, default=None,
                   help="decode steps with more requests decoding than this run without drafts")
    p.add_argument("--spec-tree", default=None,
                   help="eagle: greedy requests draft this tree of rank paths, e.g. '0;1;0.0;0.0.0'")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="decode's zero-bubble loop (plan step N+1 while step N runs); default: on with CUDA")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="multi-step decode: steps where every request decodes greedily with nothing reading its "
                        "logits run up to this many decode steps per round of host work (a small model on a GPU)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="vLLM's --stream-interval: a request's tokens stream in messages of this many (its first "
                        "and last at once); fewer messages for the router to format and the client to read")
    p.add_argument("--redis-url", default="", help="registry; default: an in-process registry in the router")
    p.add_argument("--registry-namespace", default="baton", help="Redis key namespace (one per stack)")
    p.add_argument("--port", type=int, default=8000, help="router HTTP port")
    p.add_argument("--api-key", action="append", default=[], help="require this bearer key (repeatable)")
    p.add_argument("--api-keys-file", type=Path, default=None,
                   help="more keys, one per line; re-read when it changes (rotation without a restart)")
    p.add_argument("--tool-call-parser", default="", help="how tool_choice=auto reads calls: hermes (default), "
                   "llama3_json, pythonic, gemma4")
    p.add_argument("--reasoning-parser", default="", help="think or gemma4: split reasoning from answers")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults: auto (the model's generation_config), vllm (none) or a directory")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-bytes", type=int, default=512 << 20, help="per engine instance")
    p.add_argument("--kv-offload-bytes", type=int, default=0,
                   help="per engine: host memory for evicted prefix blocks, restored instead of recomputed "
                        "(a preempted request's context swaps back in); 0 = off")
    p.add_argument("--kv-spill", action="store_true",
                   help="disagg: a decode parks a preempted request's context in kv_transfer's pool and reads it "
                        "back when it resumes, instead of recomputing it")
    p.add_argument("--kv-transfer-capacity-bytes", type=int, default=2 << 30, help="handoff store size")
    p.add_argument("--torch-threads", type=int, default=0,
                   help="per engine process, fixed; 0 = cores / engines, and all of them while the other "
                        "engines have no work (--no-core-share: always cores / engines)")
    p.add_argument("--core-share", action=argparse.BooleanOptionalAction, default=True,
                   help="engines lend each other their cores while idle (shared/engine/core_share.py)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32",
                   help="weights (CPU: activations stay fp32); auto = the fastest whose fidelity bound holds")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPE_CHOICES, default="auto",
                   help="KV cache and handoffs; auto = the weights' dtype; fp8 (e4m3) or fp8_e5m2: a byte a value (CPU)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                   help="int8 per channel, q4_1: 4-bit blocks made at load, or gguf: a GGUF model's projections "
                        "in the file's own blocks")
    p.add_argument("--state-dir", type=Path, default=Path(".baton"))
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--max-restarts", type=int, default=3,
                   help="restarts of a child that fails (backoff doubling from --restart-backoff); then the "
                        "stack stops, exit 1")
    p.add_argument("--migration-limit", type=int, default=3,
                   help="times a request whose decode dies mid-stream moves to another instance (0 = never)")
    p.add_argument("--decode-stall-timeout", type=float, default=30.0,
                   help="seconds a decode stream may go silent (no token, no keepalive) before it counts as dead")
    p.add_argument("--tls", action="store_true",
                   help="mutual TLS between the services: a fresh CA and certificates in <state-dir>/certs")
    p.add_argument("--restart-backoff", type=float, default=1.0, help="seconds before a child's first restart")
    p.set_defaults(func=run_up)


def free_port() -> int:
    """A port for a child: free now and outside the ephemeral range (shared/service/ports.py)."""
    return unused_port(HOST)


def tls_dir(args: argparse.Namespace) -> Path:
    """Where `baton up --tls` writes its stack's certificates."""
    return (args.state_dir / "certs").resolve()


def plan_stack(args: argparse.Namespace) -> Stack:
    """Ports and environments of every child, before anything starts."""
    if args.spec == "eagle" and args.spec_eagle_head is None:
        raise ConfigError("--spec eagle needs --spec-eagle-head (a head saved by `baton train-draft`)")
    if args.spec == "gemma4_assistant" and args.spec_draft_model is None:
        raise ConfigError("--spec gemma4_assistant needs --spec-draft-model (the assistant's HF directory)")
    if args.prefill < 1 or args.decode < 1 or args.encoder < 0:
        raise ConfigError("--prefill and --decode must be >= 1, --encoder >= 0")
    if args.kv_spill and args.mode != "disagg":
        raise ConfigError("--kv-spill parks contexts in kv_transfer: it needs --mode disagg (colocated: "
                          "--kv-offload-bytes keeps them in the engine's host memory)")
    if args.encoder and args.mode != "disagg":
        raise ConfigError("--encoder runs beside prefill instances: it needs --mode disagg")
    engines = args.decode + (args.prefill + args.encoder if args.mode == "disagg" else 0)
    threads = args.torch_threads or max(1, (os.cpu_count() or 1) // engines)
    # engines started side by side take every core while the others are idle (one stream's prefill, then
    # its decode, each on the whole machine) and their share under load; a fixed --torch-threads is kept
    share = engines > 1 and not args.torch_threads and args.core_share
    slots = iter(range(engines))

    def core_share() -> dict[str, str]:
        if not share:
            return {}
        return {"CORE_SHARE_FILE": str((args.state_dir / "core_share").resolve()),
                "CORE_SHARE_SLOT": str(next(slots))}

    # one random token per stack: its services answer only each other (shared/grpc_auth.py)
    token = secrets.token_urlsafe(24)
    auth = {"INTERNAL_TOKEN": token, **({"TLS_DIR": str(tls_dir(args))} if args.tls else {})}
    common = {"MODEL": args.model, "MAX_MODEL_LEN": str(args.max_model_len), "REDIS_URL": args.redis_url,
              "REGISTRY_NAMESPACE": args.registry_namespace, "HOST": HOST, "CACHE_DIR": str(args.cache_dir), **auth}
    engine_common = {**common, "KV_CACHE_BYTES": str(args.kv_cache_bytes), "TORCH_THREADS": str(threads),
                     "KV_OFFLOAD_BYTES": str(args.kv_offload_bytes),
                     "DTYPE": args.dtype, "KV_CACHE_DTYPE": args.kv_cache_dtype, "QUANTIZATION": args.quantization}
    stack = Stack()
    # none of them is bound until its child starts: each pick must avoid the ones given out before it
    given: set[int] = {args.port} if args.port else set()

    def fresh_port() -> int:
        port = unused_port(HOST, avoid=given)
        given.add(port)
        return port

    def add(name: str, service: str, prefix: str, values: dict[str, str], http_port: int | None = None) -> Child:
        """A child with its own ports; an HTTP service (the router) serves /metrics on its one port."""
        port = http_port or fresh_port()
        metrics_port = port if http_port else fresh_port()
        ports = {"PORT": str(port)} if http_port else {"PORT": str(port), "METRICS_PORT": str(metrics_port)}
        env = {f"BATON_{prefix}_{k}": v for k, v in {**values, **ports}.items()}
        child = Child(name, service, f"{HOST}:{port}", f"http://{HOST}:{metrics_port}/metrics", env)
        stack.children.append(child)
        return child

    if args.mode == "disagg":
        add("kv_transfer", "kv_transfer", "KV_TRANSFER", {"REDIS_URL": args.redis_url, "HOST": HOST,
                                                          "REGISTRY_NAMESPACE": args.registry_namespace,
                                                          **auth,
                                                          "CAPACITY_BYTES": str(args.kv_transfer_capacity_bytes)})
        for i in range(args.prefill):
            add(f"prefill-{i}", "prefill", "PREFILL",
                {**engine_common, **core_share(), "INSTANCE_ID": f"prefill-{i}"})
        for i in range(args.encoder):
            add(f"encoder-{i}", "encoder", "ENCODER", {**engine_common, "INSTANCE_ID": f"encoder-{i}"})
    role = "decode" if args.mode == "disagg" else "colocated"
    spec = {"SPEC": args.spec, "NUM_SPECULATIVE_TOKENS": str(args.num_speculative_tokens)}
    if args.async_scheduling is not None:
        spec["ASYNC_SCHEDULING"] = str(args.async_scheduling).lower()
    if args.num_scheduler_steps != 1:
        spec["NUM_SCHEDULER_STEPS"] = str(args.num_scheduler_steps)
    if args.stream_interval != 1:
        spec["STREAM_INTERVAL"] = str(args.stream_interval)
    if args.spec_eagle_head is not None:
        spec["SPEC_EAGLE_HEAD"] = str(args.spec_eagle_head)
    if args.spec_draft_model is not None:
        spec["SPEC_DRAFT_MODEL"] = str(args.spec_draft_model)
    if args.spec_disable_batch_size is not None:
        spec["SPEC_DISABLE_BATCH_SIZE"] = str(args.spec_disable_batch_size)
    if args.spec_tree is not None:
        spec["SPEC_TREE"] = args.spec_tree
    for i in range(args.decode):
        add(f"decode-{i}", role, "DECODE", {**engine_common, **core_share(), **spec, "ROLE": role,
                                             "INSTANCE_ID": f"decode-{i}",
                                             "KV_SPILL": str(args.kv_spill).lower()})
    static = ",".join(f"{c.service}={c.address}" for c in stack.children)
    router_id = f"router-{uuid.uuid4().hex[:12]}"
    router = add("router", "router", "ROUTER", {
        **common, "MODE": args.mode, "API_KEYS": ",".join(args.api_key),
        "TOOL_CALL_PARSER": args.tool_call_parser, "REASONING_PARSER": args.reasoning_parser,
        "GENERATION_CONFIG": args.generation_config, "INSTANCE_ID": router_id,
        "MIGRATION_LIMIT": str(args.migration_limit), "DECODE_STALL_TIMEOUT_S": str(args.decode_stall_timeout),
        **({"API_KEYS_FILE": str(args.api_keys_file.resolve())} if args.api_keys_file else {}),
        "STATIC_INSTANCES": "" if args.redis_url else static,
    }, http_port=args.port)
    router.instance_id = router_id
    return stack


def start_children(stack: Stack, state_dir: Path) -> None:
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for child in stack.children:
        child.log_path = logs / f"{child.name}.log"
        child.log_path.write_bytes(b"")
        start_child(child)


def start_child(child: Child) -> None:
    """Start (or restart: its log goes on) one child."""
    assert child.log_path is not None
    command = {"kv_transfer": "kv-transfer", "colocated": "decode"}.get(child.service, child.service)
    with child.log_path.open("ab") as log:  # the child holds its own descriptor
        child.proc = subprocess.Popen(
            [sys.executable, "-m", "shared.cli.main", command], env={**os.environ, **child.env},
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    print(f"baton: started {child.name} (pid {child.proc.pid}) on {child.address}, log {child.log_path}",
          flush=True)


def healthy(child: Child, expected: Mapping[str, int] | None = None) -> bool:
    """`expected` (the router): instances per service it must see before it counts as ready, so that the
    first requests after "baton ready" can go to every instance, not only those its registry polled first."""
    if child.service == "router":
        try:
            with urllib.request.urlopen(f"http://{child.address}/health", timeout=2) as r:
                body = json.loads(r.read() or b"{}")
        except (OSError, ValueError, http.client.HTTPException):  # not up yet, or another server's port
            return False
        # another server on the port answers too: only our router names the id it was given
        if body.get("instance_id") != child.instance_id:
            return False
        seen = body.get("instances") or {}
        return all(seen.get(service, 0) >= n for service, n in (expected or {}).items())
    import asyncio

    from shared.grpc_common import check_health

    return asyncio.run(check_health(child.address, timeout_s=1.0))


def wait_ready(stack: Stack, timeout_s: float, stopping: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(stack.children)
    expected = collections.Counter(c.service for c in stack.children if c.service != "router")
    while pending and not stopping():
        for child in list(pending):
            if child.proc is not None and child.proc.poll() is not None:
                raise UnavailableError(f"{child.name} exited with {child.proc.returncode}; see {child.log_path}")
            if healthy(child, expected if child.service == "router" else None):
                pending.remove(child)
                print(f"baton: {child.name} is healthy", flush=True)
        if pending and time.monotonic() > deadline:
            raise UnavailableError(f"not healthy after {timeout_s:.0f} s: {[c.name for c in pending]}")
        if pending:
            names = ", ".join(c.name for c in pending)
            print(f"baton: waiting for {names} (loading models) ...", flush=True)
            time.sleep(1.0)


def write_stack_json(stack: Stack, state_dir: Path) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / "stack.json.tmp"  # whole or absent: tests and operators read it while we run
    tmp.write_text(json.dumps(stack.to_json(), indent=2))
    tmp.replace(state_dir / "stack.json")


def stop_children(stack: Stack, grace_s: float = 20.0) -> None:
    running = [c for c in stack.children if c.proc is not None and c.proc.poll() is None]
    for child in reversed(running):  # router first: no new work while engines drain
        child.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
    deadline = time.monotonic() + grace_s
    for child in running:
        try:
            child.proc.wait(max(0.1, deadline - time.monotonic()))  # type: ignore[union-attr]
        except subprocess.TimeoutExpired:
            child.proc.kill()  # type: ignore[union-attr]
            child.proc.wait()  # type: ignore[union-attr]


def run_up(args: argparse.Namespace) -> int:
    # convert a GGUF once here, not in every child at once; a checkpoint that cannot load fails here
    check_checkpoint(args.model, args.cache_dir)
    try:
        precision = resolve_precision(args.dtype, args.kv_cache_dtype, "cpu")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    weights = precision.describe() if args.quantization == "none" else \
        f"{args.quantization} projections; {precision.describe()}"
    print(f"baton: precision (--dtype {args.dtype}, --kv-cache-dtype {args.kv_cache_dtype}, --quantization "
          f"{args.quantization}): {weights}", flush=True)
    stack = plan_stack(args)
    check_ports_free(list(stack.children), HOST)
    if args.tls:  # a fresh CA per stack; this process checks its children's health with the router's pair
        make_dev_certs(tls_dir(args), CERT_SERVICES)
        set_tls(tls_dir(args), "router")
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        start_children(stack, args.state_dir)
        wait_ready(stack, args.ready_timeout, lambda: stopping)
        if stopping:
            return 130
        write_stack_json(stack, args.state_dir)
        print(f"baton ready: http://{HOST}:{args.port}/v1", flush=True)

        def restart(child: SupervisedChild) -> None:
            assert isinstance(child, Child)
            start_child(child)
            write_stack_json(stack, args.state_dir)  # its new pid

        supervisor = Supervisor(list(stack.children), RestartPolicy(args.max_restarts, args.restart_backoff), restart,
                                say=lambda line: print(line, flush=True))
        while not stopping:
            time.sleep(0.2)
            reason = supervisor.poll()
            if reason is not None:
                print(f"baton: {reason}", flush=True)
                return 1
    finally:
        print("baton: stopping ...", flush=True)
        stop_children(stack)
    return 0

