"""Servers under test, started and stopped by the benchmark, all on 127.0.0.1.

    system            what runs                                   cores
    baton             `baton up` (router, prefill, kv_transfer, decode)  shared: each engine 1 torch thread,
                                                                  every core while the other is idle
    baton-fixed-shares  `baton up --no-core-share`                 shared, 1 torch thread per engine always
    baton-colocated   `baton up --mode colocated` (one engine)    shared, 2 torch threads
    baton-pinned-colo the colocated stack, engine `taskset -c 0,1`       2 torch threads
    baton-pinned-disagg prefill `taskset -c 0`, decode `taskset -c 1`  1 torch thread each
    vllm              `vllm serve` from bench/peers' venv (fp32)  vLLM's own binding

Each `Server` is a context manager: enter starts it and waits for /health,
exit stops every process it started (SIGTERM, then SIGKILL after a grace).
The pinned stacks are planned by `baton up`'s own `plan_stack`, then each
service is launched under `taskset`; router and kv_transfer float.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from bench.serve_load import RequestSpec
from shared.cli.main import build_parser
from shared.cli.up_cmd import plan_stack
from shared.models.loader import ALIASES

HOST = "127.0.0.1"
MODEL_NAME = "smollm2-135m"
SYSTEMS = ("baton", "baton-fixed-shares", "baton-colocated", "baton-pinned-colo", "baton-pinned-disagg", "vllm",
           "vllm-allcores", "llamacpp")
# a baton system may name its precision after an @ (baton-colocated@int8): the `baton up` flags it adds
# (int8-bf16-kv: int8 projections beside a bf16 KV cache, which halves what decode attention reads)
PRECISION_FLAGS = {"float32": [], "bfloat16": ["--dtype", "bfloat16"], "int8": ["--quantization", "int8"],
                   "int8-bf16-kv": ["--quantization", "int8", "--kv-cache-dtype", "bfloat16"],
                   "int8-fp8-kv": ["--quantization", "int8", "--kv-cache-dtype", "fp8"],
                   "gguf": ["--quantization", "gguf"]}
# vllm@bfloat16: its --dtype (default float32, as baton's); vllm@bfloat16-fp8-kv adds its fp8 KV cache
VLLM_PRECISIONS = {"float32": ["--dtype", "float32"], "bfloat16": ["--dtype", "bfloat16"],
                   "bfloat16-fp8-kv": ["--dtype", "bfloat16", "--kv-cache-dtype", "fp8"]}
# a baton or vllm system may end in +si<N> (vllm-allcores@bfloat16+si8): the server's --stream-interval, which
# both spell alike: a request's tokens stream in chunks of N (the first and last at once)
STREAM_INTERVAL_MARK = "+si"
# Set when kv_transfer's 30 s lease could expire behind a long prefill queue (32 concurrent 256-token
# prompts on one core: 499s). Prefill now renews the lease while its prompt waits; the published runs
# kept this setting, so it stays until a run without it is compared.
BATON_ENV = {"BATON_KV_TRANSFER_LEASE_TIMEOUT_S": "300"}
# vLLM's CPU build binds its OpenMP threads to all cores but one and leaves that one to the API
# server (VLLM_CPU_OMP_THREADS_BIND=auto): `vllm`. Which binding wins depends on the load (both cores
# lost at 1 request in flight and won at 32 in earlier runs), so `vllm-allcores` binds every core
# and reserves none, and a comparison runs both.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
VLLM_ALLCORES_ENV = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
logger = logging.getLogger("bench.serve")


@dataclass
class ServerConfig:
    """Where a server keeps its files and what it serves."""

    work_dir: Path  # logs, state, vLLM's cache
    hf_dir: Path  # the HF export both systems load (vLLM reads it; baton loads its alias)
    vllm_venv: Path
    port: int
    llamacpp_venv: Path = Path.home() / ".cache/baton/peers/llamacpp-venv"
    max_model_len: int = 2048
    ready_timeout_s: float = 600.0


@dataclass
class Server:
    """One system under test; `base_url` is valid between enter and exit."""

    system: str
    config: ServerConfig
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    started_s: float = 0.0
    ready_after_s: float = 0.0
    up_args: tuple[str, ...] = ()  # baton: more `baton up` options (e.g. --decode 2)
    env: dict[str, str] = field(default_factory=dict)  # baton: more settings (e.g. BATON_ROUTER_*)
    name: str = ""  # where its logs go under work_dir/logs (default: the system)

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.config.port}"

    @property
    def base_system(self) -> str:
        return self._parts[0]

    @property
    def precision_flags(self) -> list[str]:
        return PRECISION_FLAGS[self._parts[1] or "float32"]

    @property
    def _parts(self) -> tuple[str, str, int]:
        """The system's base, precision ("" = its default) and stream interval (1 = each step's tokens)."""
        head, mark, interval = self.system.partition(STREAM_INTERVAL_MARK)
        base, _, precision = head.partition("@")
        return base, precision, int(interval) if mark and interval.isdigit() else (0 if mark else 1)

    @property
    def stream_interval_flags(self) -> list[str]:
        interval = self._parts[2]
        return [] if interval == 1 else ["--stream-interval", str(interval)]

    def __enter__(self) -> Server:
        base, precision, interval = self._parts
        known = PRECISION_FLAGS if base.startswith("baton") else VLLM_PRECISIONS if base.startswith("vllm") else {}
        if base not in SYSTEMS or (precision and precision not in known) or interval < 1 \
                or (interval > 1 and base not in ("baton", "baton-colocated", "baton-fixed-shares", "vllm",
                                                  "vllm-allcores")):
            raise ValueError(f"unknown system {self.system!r}; known: {', '.join(SYSTEMS)}, a baton one with "
                             f"@{'|'.join(PRECISION_FLAGS)}, a vllm one with @{'|'.join(VLLM_PRECISIONS)}, "
                             f"either (not pinned) with {STREAM_INTERVAL_MARK}<N> for a stream interval")
        log_dir = self.log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.started_s = time.monotonic()
        try:
            if base.startswith("vllm"):
                self._start_vllm(log_dir, all_cores=base == "vllm-allcores", flags=VLLM_PRECISIONS[precision or "float32"])
            elif base == "llamacpp":
                self._start_llamacpp(log_dir)
            elif base.startswith("baton-pinned"):
                self._start_pinned(log_dir, disagg=base.endswith("disagg"))
            else:
                self._start_baton_up(log_dir, colocated=base == "baton-colocated",
                                     fixed_shares=base == "baton-fixed-shares")
            self._wait_healthy(log_dir)
        except BaseException:
            self.stop()
            raise
        self.ready_after_s = time.monotonic() - self.started_s
        logger.info("%s healthy after %.0f s", self.system, self.ready_after_s)
        return self

    @property
    def log_dir(self) -> Path:
        return self.config.work_dir / "logs" / (self.name or self.system)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _spawn(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        with log_path.open("wb") as log:
            self.procs.append(subprocess.Popen(argv, env={**os.environ, **env}, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True))

    def _start_baton_up(self, log_dir: Path, colocated: bool, fixed_shares: bool = False) -> None:
        argv = [sys.executable, "-m", "shared.cli.main", "up", "--model", MODEL_NAME,
                "--port", str(self.config.port), "--max-model-len", str(self.config.max_model_len),
                "--state-dir", str(log_dir / "state"), *self.precision_flags, *self.stream_interval_flags]
        if colocated:
            argv += ["--mode", "colocated"]
        if fixed_shares:  # each engine on cores / engines threads even while the other is idle
            argv += ["--no-core-share"]
        self._spawn([*argv, *self.up_args], {**BATON_ENV, **self.env}, log_dir / "up.log")

    def _start_pinned(self, log_dir: Path, disagg: bool) -> None:
        # through `baton up`'s own parser, so every option it grows has its default here too
        args = build_parser().parse_args([
            "up", "--model", MODEL_NAME, "--mode", "disagg" if disagg else "colocated",
            "--registry-namespace", "bench", "--port", str(self.config.port),
            "--max-model-len", str(self.config.max_model_len), "--torch-threads", "1" if disagg else "2",
            *self.precision_flags,
        ])  # fmt: skip
        cores = {"prefill": "0", "decode": "1", "colocated": "0,1"}
        for child in plan_stack(args).children:
            command = {"kv_transfer": "kv-transfer", "colocated": "decode"}.get(child.service, child.service)
            argv = [sys.executable, "-m", "shared.cli.main", command]
            if child.service in cores:
                argv = ["taskset", "-c", cores[child.service], *argv]
            self._spawn(argv, {**BATON_ENV, **child.env}, log_dir / f"{child.name}.log")

    def _start_vllm(self, log_dir: Path, all_cores: bool, flags: list[str]) -> None:
        vllm = self.config.vllm_venv / "bin" / "vllm"
        if not vllm.exists():
            raise FileNotFoundError(f"{vllm} missing: run bench/peers/setup_vllm.sh first")
        cache = self.config.work_dir / "vllm-cache"
        env = {**VLLM_ENV, **(VLLM_ALLCORES_ENV if all_cores else {}), "VLLM_CACHE_ROOT": str(cache),
               "HOME": str(self.config.work_dir / "home")}
        (self.config.work_dir / "home").mkdir(parents=True, exist_ok=True)
        argv = [str(vllm), "serve", str(self.config.hf_dir), "--served-model-name", MODEL_NAME,
                "--max-model-len", str(self.config.max_model_len), *flags, *self.stream_interval_flags,
                "--host", HOST, "--port", str(self.config.port)]
        self._spawn(argv, env, log_dir / "vllm.log")

    def adapt(self, specs: list[RequestSpec]) -> list[RequestSpec]:
        """Bodies this system takes. llama-cpp-python's server reads prompts only as text and has no
        ignore_eos or min_tokens: token-id prompts go as their decoded text (which re-encodes to about the
        same length) and every special token (the GGUF has two that end a reply) is banned with a logit bias.
        Its stream reports no usage, so the client counts text chunks as tokens: a few replies of 128 tokens
        count 86-97 where tokens of a multi-byte character arrive as one chunk."""
        if self.system != "llamacpp":
            return specs
        tok = _tokenizer(self.config.hf_dir)
        adapted = []
        for spec in specs:
            body = {k: v for k, v in spec.body.items() if k not in ("min_tokens", "ignore_eos")}
            if isinstance(body.get("prompt"), list):
                body["prompt"] = tok.decode(body["prompt"])
            if spec.body.get("ignore_eos"):
                body["logit_bias"] = {str(i): -100.0 for i in tok.all_special_ids}
            adapted.append(RequestSpec(spec.path, body))
        return adapted

    def _start_llamacpp(self, log_dir: Path) -> None:
        python = self.config.llamacpp_venv / "bin" / "python"
        if not python.exists():
            raise FileNotFoundError(f"{python} missing: run bench/peers/setup_llama_cpp.sh first")
        # the packaged GGUF itself (Q4_1): llama.cpp computes on the quantized weights
        argv = [str(python), "-m", "llama_cpp.server", "--model", str(ALIASES[MODEL_NAME]()),
                "--model_alias", MODEL_NAME, "--n_ctx", str(self.config.max_model_len),
                "--n_threads", str(os.cpu_count() or 1), "--host", HOST, "--port", str(self.config.port),
                # by default a new request interrupts the one running: queue them instead
                "--interrupt_requests", "False"]
        self._spawn(argv, {}, log_dir / "llamacpp.log")

    def _wait_healthy(self, log_dir: Path) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{self.system}: {proc.args!r} exited with {proc.returncode}; logs in {log_dir}")
            health = self.system == "llamacpp" or _http_ok(f"{self.base_url}/health")  # it has no /health
            if health and _http_ok(f"{self.base_url}/v1/models"):
                return
            time.sleep(2.0)
        raise TimeoutError(f"{self.system} not healthy after {self.config.ready_timeout_s:.0f} s; logs in {log_dir}")

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM every process group we started (router first: it was started last), then SIGKILL.

        `baton up` puts each service in its own session and stops them on SIGTERM;
        any still alive afterwards (found in its stack.json) are killed too.
        """
        stack_json = self.log_dir / "state" / "stack.json"
        children = _stack_pids(stack_json)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
            _signal_group(proc, signal.SIGKILL)  # stragglers of the group (vLLM's engine core)
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
                logger.warning("%s: killed leftover service pid %d", self.system, pid)
            except ProcessLookupError:
                pass
        stack_json.unlink(missing_ok=True)
        self.procs.clear()


@functools.lru_cache(maxsize=2)
def _tokenizer(hf_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_dir))


def _stack_pids(stack_json: Path) -> list[int]:
    if not stack_json.exists():
        return []
    services = json.loads(stack_json.read_text())["services"]
    return [int(s["pid"]) for s in services if s.get("pid")]


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)  # start_new_session made pid the group id
    except ProcessLookupError:
        pass


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def export_hf(work_dir: Path) -> Path:
    """The dequantized SmolLM2 weights as an HF directory (`baton export-hf`), once per work dir."""
    out = work_dir / "hf-smollm2-135m"
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, "-m", "shared.cli.main", "export-hf", "--model", MODEL_NAME,
                        "--out", str(out)], check=True)
    return out
