"""API fuzzing with schemathesis, from the router's own OpenAPI document, against a real disaggregated stack
(router -> prefill -> kv_transfer -> decode over gRPC, a tiny Gemma 4 checkpoint so generations are quick).

Every generated request must be answered, within a timeout, with a status below 500, and every error in
OpenAI's shape ({"error": {"message", "type", ...}}). A negative `seed` once overflowed the uint64 wire
field into a 500: requests reach the engines, so the wire is fuzzed too. `BATON_TEST_FUZZ_EXAMPLES` sets
how many requests each operation gets (default 120: about a thousand in all, a few minutes).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.helpers.gemma4 import tiny_gemma4_checkpoint
from tests.helpers.stack import BatonStack, start_stack

pytestmark = pytest.mark.slow

KEY = "fuzz-key"
EXAMPLES = int(os.environ.get("BATON_TEST_FUZZ_EXAMPLES", "120"))
TIMEOUT_S = 60.0  # a generation is at most MAX_TOKENS tokens of a tiny model: anything longer is a hang
MAX_TOKENS = 8
OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/chat/completions/batch"),
              ("POST", "/v1/responses"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/models"),
              ("GET", "/v1/models/{model}")]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BatonStack]:
    checkpoint: Path = tiny_gemma4_checkpoint(tmp_path_factory.mktemp("fuzz") / "tiny", moe=False)
    started = start_stack(tmp_path_factory.mktemp("fuzz-stack"), "--model", str(checkpoint), "--max-model-len",
                          "256", "--kv-cache-bytes", str(16 << 20), "--prefill", "1", "--decode", "1",
                          "--api-key", KEY, env={"BATON_ROUTER_MAX_TOKENS_LIMIT": str(MAX_TOKENS)})
    yield started
    started.stop()


def _check(response: httpx.Response, what: str) -> None:
    assert response.status_code < 500, f"{what} -> {response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        error = response.json().get("error")
        assert isinstance(error, dict) and isinstance(error.get("message"), str) and error.get("type"), \
            f"{what} -> {response.status_code}, not OpenAI's error shape: {response.text[:500]}"


def _exchange(http: httpx.Client, case: Any) -> httpx.Response:
    kwargs: dict[str, Any] = {"params": case.query or None, "headers": {"Authorization": f"Bearer {KEY}"}}
    if case.method == "POST":
        kwargs["json"] = case.body
    return http.request(case.method, case.formatted_path, **kwargs)


def _served_model_only(document: dict[str, Any], name: str) -> dict[str, Any]:
    """The document with every body's `model` field pinned to the served name: a random name is a 404 before
    anything reaches an engine, and the engines are what the fuzzing is for."""
    for component in document["components"]["schemas"].values():
        if "model" in component.get("properties", {}):
            component["properties"]["model"] = {"type": "string", "enum": [name]}
    return document


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_fuzzed_requests_never_500_or_hang(stack: BatonStack, method: str, path: str) -> None:
    base = stack.base_url.removesuffix("/v1")
    with httpx.Client(base_url=base, timeout=TIMEOUT_S) as http:
        name = http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]
        schema = schemathesis.openapi.from_dict(_served_model_only(http.get("/openapi.json").json(), name))
        operation = schema[path][method]
        seen: list[int] = []

        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def fuzz(case: Any) -> None:
            try:
                response = _exchange(http, case)
            except httpx.TimeoutException:
                pytest.fail(f"{method} {path} hung past {TIMEOUT_S} s on {case.body!r:.500}")
            _check(response, f"{method} {path} {case.body!r:.300}")
            seen.append(response.status_code)

        fuzz()
    if method == "POST":  # (a GET without parameters has few distinct cases: hypothesis stops early)
        assert len(seen) >= min(EXAMPLES, 20)
    if method == "POST" and path != "/detokenize":  # some fuzzed requests were served, not all refused
        assert 200 in seen, sorted(set(seen))
    # the router still serves afterwards, and the engines freed what the requests held
    with httpx.Client(base_url=base, timeout=TIMEOUT_S, headers={"Authorization": f"Bearer {KEY}"}) as http:
        ok = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200, ok.text
