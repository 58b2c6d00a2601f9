"""`baton up`'s plan: which environment each child gets (no process is started)."""

from __future__ import annotations

import pytest

from shared.cli.main import build_parser
from shared.cli.up_cmd import plan_stack
from shared.errors import ConfigError


def plan(*argv: str):  # type: ignore[no-untyped-def]
    return plan_stack(build_parser().parse_args(["up", *argv]))


def test_spec_settings_reach_every_decode_and_only_decode() -> None:
    stack = plan("--spec", "ngram", "--num-speculative-tokens", "5", "--decode", "2")
    decodes = [c for c in stack.children if c.service == "decode"]
    assert len(decodes) == 2
    for child in decodes:
        assert child.env["BATON_DECODE_SPEC"] == "ngram"
        assert child.env["BATON_DECODE_NUM_SPECULATIVE_TOKENS"] == "5"
    assert not any("SPEC" in k for c in stack.children if c.service != "decode" for k in c.env)


def test_eagle_needs_a_head() -> None:
    with pytest.raises(ConfigError, match="spec-eagle-head"):
        plan("--spec", "eagle")
    stack = plan("--spec", "eagle", "--spec-eagle-head", "/tmp/head.safetensors", "--mode", "colocated")
    (decode,) = [c for c in stack.children if c.service == "colocated"]
    assert decode.env["BATON_DECODE_SPEC_EAGLE_HEAD"] == "/tmp/head.safetensors"


def test_default_stack_speculates_nothing() -> None:
    stack = plan()
    assert {c.service for c in stack.children} == {"kv_transfer", "prefill", "decode", "router"}
    (decode,) = [c for c in stack.children if c.service == "decode"]
    assert decode.env["BATON_DECODE_SPEC"] == "none"


def test_zero_bubble_loop_is_the_engines_choice_unless_told() -> None:
    (decode,) = [c for c in plan().children if c.service == "decode"]
    assert "BATON_DECODE_ASYNC_SCHEDULING" not in decode.env
    (decode,) = [c for c in plan("--async-scheduling").children if c.service == "decode"]
    assert decode.env["BATON_DECODE_ASYNC_SCHEDULING"] == "true"
    (decode,) = [c for c in plan("--no-async-scheduling").children if c.service == "decode"]
    assert decode.env["BATON_DECODE_ASYNC_SCHEDULING"] == "false"


def test_num_scheduler_steps_reaches_the_decode_engine() -> None:
    (decode,) = [c for c in plan().children if c.service == "decode"]
    assert "BATON_DECODE_NUM_SCHEDULER_STEPS" not in decode.env
    (decode,) = [c for c in plan("--num-scheduler-steps", "8").children if c.service == "decode"]
    assert decode.env["BATON_DECODE_NUM_SCHEDULER_STEPS"] == "8"


def test_num_scheduler_steps_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.decode.settings import DecodeSettings

    monkeypatch.setenv("BATON_DECODE_NUM_SCHEDULER_STEPS", "8")
    assert DecodeSettings().engine_config("decode").num_scheduler_steps == 8


def test_stream_interval_reaches_the_decode_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.decode.settings import DecodeSettings

    (decode,) = [c for c in plan().children if c.service == "decode"]
    assert "BATON_DECODE_STREAM_INTERVAL" not in decode.env
    (decode,) = [c for c in plan("--stream-interval", "4").children if c.service == "decode"]
    for key, value in decode.env.items():
        monkeypatch.setenv(key, value)
    assert DecodeSettings().engine_config("decode").stream_interval == 4
    monkeypatch.setenv("BATON_DECODE_STREAM_INTERVAL", "0")
    with pytest.raises(ValueError, match="stream_interval"):
        DecodeSettings()


def test_spec_disable_batch_size_reaches_the_decode_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.decode.settings import DecodeSettings

    (decode,) = [c for c in plan("--spec", "ngram", "--spec-disable-batch-size", "4").children
                 if c.service == "decode"]
    for key, value in decode.env.items():
        monkeypatch.setenv(key, value)
    assert DecodeSettings().engine_config("decode").spec_disable_batch_size == 4
    (decode,) = [c for c in plan("--spec", "ngram").children if c.service == "decode"]
    assert "BATON_DECODE_SPEC_DISABLE_BATCH_SIZE" not in decode.env


def test_spec_tree_reaches_the_decode_engine(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from services.decode.settings import DecodeSettings

    head = tmp_path / "head.safetensors"
    (decode,) = [c for c in plan("--spec", "eagle", "--spec-eagle-head", str(head), "--spec-tree", "0;1;0.0").children
                 if c.service == "decode"]
    for key, value in decode.env.items():
        monkeypatch.setenv(key, value)
    assert DecodeSettings().engine_config("decode").spec_tree == "0;1;0.0"


def test_every_service_gets_the_stacks_one_internal_token() -> None:
    stack = plan("--decode", "2")
    tokens = [v for c in stack.children for k, v in c.env.items() if k.endswith("_INTERNAL_TOKEN")]
    assert len(tokens) == len(stack.children) == 5 and len(set(tokens)) == 1 and len(tokens[0]) >= 24
    assert tokens[0] not in {v for c in plan().children for v in c.env.values()}  # one per stack


def _core_share(child) -> tuple[str, str] | None:  # type: ignore[no-untyped-def]
    prefix = {"prefill": "BATON_PREFILL_", "decode": "BATON_DECODE_"}[child.service]
    if f"{prefix}CORE_SHARE_FILE" not in child.env:
        return None
    return child.env[f"{prefix}CORE_SHARE_FILE"], child.env[f"{prefix}CORE_SHARE_SLOT"]


def test_engines_side_by_side_share_cores_through_one_file_with_a_slot_each() -> None:
    stack = plan("--prefill", "2", "--decode", "2")
    shares = [_core_share(c) for c in stack.children if c.service in ("prefill", "decode")]
    assert all(s is not None for s in shares)
    assert len({f for f, _ in shares}) == 1  # type: ignore[misc]
    assert sorted(int(slot) for _, slot in shares) == [0, 1, 2, 3]  # type: ignore[misc]


def test_a_fixed_thread_count_one_engine_or_no_core_share_shares_nothing() -> None:
    for argv in (("--torch-threads", "1"), ("--no-core-share",)):
        stack = plan(*argv)
        assert all(_core_share(c) is None for c in stack.children if c.service in ("prefill", "decode"))
    (colocated,) = [c for c in plan("--mode", "colocated").children if c.service == "colocated"]
    assert not any("CORE_SHARE" in k for k in colocated.env)


def test_no_two_children_get_one_port_nor_the_routers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ports are picked before any child binds one: every pick avoids those given out before it (a router and
    a prefill on one port left `baton up`'s health probe reading a gRPC server's reply)."""
    import random

    from shared.service import ports

    router_port = ports.unused_port(rng=random.Random(0))
    # every pick draws the same sequence: without the avoid set, each child would get router_port
    unseeded = random.Random
    monkeypatch.setattr(ports.random, "Random", lambda *seed: unseeded(*seed) if seed else unseeded(0))
    stack = plan("--prefill", "2", "--decode", "2", "--port", str(router_port))
    given = [int(v) for c in stack.children for k, v in c.env.items() if k.endswith(("_PORT", "_METRICS_PORT"))
             and not k.endswith("REDIS_PORT")]
    assert len(given) == len(set(given)) and given.count(router_port) == 1
