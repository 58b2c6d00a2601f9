"""deploy/compose/docker-compose.yml against the Compose Specification, with no docker engine.

Two independent checks of the interpolated file (what `docker compose config` would see):
the Compose Specification's JSON schema (the copy check-jsonschema vendors, validated with
jsonschema), and the `compose-spec` package's parser (Rust `compose_spec` bindings). Then
what the stack needs: scalable services, real health checks, variables that name settings.
"""

from __future__ import annotations

import importlib.resources
import json
import re
from typing import Any

import pytest
import yaml

from tests.deploy.compose_file import (
    COMPOSE_FILE,
    REPO_ROOT,
    InterpolationError,
    load_compose,
    service_environment,
)
from tests.deploy.conftest import require_module
from tests.deploy.settings_check import parse_for_service, unknown_baton_variables

OTEL_ENV_FILE = REPO_ROOT / "deploy" / "compose" / "otel.env"
MTLS_FILE = REPO_ROOT / "deploy" / "compose" / "mtls.yml"
SCALED = ("prefill", "decode", "kv_transfer")
BATON_SERVICES = {"router": "BATON_ROUTER_", "prefill": "BATON_PREFILL_", "decode": "BATON_DECODE_",
                  "kv_transfer": "BATON_KV_TRANSFER_"}


def _env_file(path: Any) -> dict[str, str]:
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    return dict(ln.split("=", 1) for ln in lines if ln and not ln.startswith("#"))


REQUIRED = {"BATON_INTERNAL_TOKEN": "stack-secret"}  # the one variable without a default
VARIABLE_SETS = {
    "defaults": REQUIRED,
    "otel": {**REQUIRED, **_env_file(OTEL_ENV_FILE)},
    "overrides": {**REQUIRED, "BATON_MODEL": "/models/gemma3-270m", "BATON_API_KEYS": "k1,k2",
                  "BATON_HTTP_PORT": "8080", "BATON_DEVICE": "cuda", "BATON_DTYPE": "bfloat16",
                  "BATON_IMAGE": "registry.example/baton:1"},
}


def _compose_schema() -> dict[str, Any]:
    require_module("check_jsonschema", "check-jsonschema")
    path = importlib.resources.files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    return dict(json.loads(path.read_text()))


@pytest.mark.parametrize("variables", list(VARIABLE_SETS), ids=list(VARIABLE_SETS))
def test_compose_file_matches_the_compose_spec_schema(variables: str) -> None:
    jsonschema = require_module("jsonschema", "jsonschema")
    schema = _compose_schema()
    validator_cls = jsonschema.validators.validator_for(schema)
    validator = validator_cls(schema, format_checker=validator_cls.FORMAT_CHECKER)
    compose = load_compose(VARIABLE_SETS[variables])
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert not errors, "\n".join(errors)


def test_the_schema_check_catches_a_bad_file() -> None:
    """The validator is live: an unknown service key and a bad depends_on condition are both reported."""
    jsonschema = require_module("jsonschema", "jsonschema")
    schema = _compose_schema()
    compose = load_compose(REQUIRED)
    compose["services"]["router"]["restart_policy"] = "always"
    compose["services"]["decode"]["depends_on"]["redis"]["condition"] = "service_ready"
    errors = list(jsonschema.validators.validator_for(schema)(schema).iter_errors(compose))
    assert any("restart_policy" in e.message for e in errors)
    assert any(list(e.absolute_path)[:2] == ["services", "decode"] for e in errors)


@pytest.mark.parametrize("variables", list(VARIABLE_SETS), ids=list(VARIABLE_SETS))
def test_compose_spec_package_parses_and_validates_the_file(variables: str) -> None:
    compose_spec = require_module("compose_spec", "compose-spec")
    compose = load_compose(VARIABLE_SETS[variables])
    parsed = compose_spec.PyCompose.from_yaml(yaml.safe_dump(compose))
    parsed.validate()
    assert set(parsed.service_names()) == {"redis", "router", "prefill", "decode", "kv_transfer", "otel-collector"}


def test_scaled_services_publish_no_host_port_and_advertise_their_own_hostname() -> None:
    services = load_compose(REQUIRED)["services"]
    for name in SCALED:
        svc = services[name]
        assert "ports" not in svc and "container_name" not in svc and "hostname" not in svc, name
        script = " ".join([*svc.get("entrypoint", []), *svc.get("command", [])])
        var = f"{BATON_SERVICES[name]}ADVERTISE_HOST"
        assert re.search(rf"\b{var}=\$\{{{var}:-\$\(hostname\)\}}", script), f"{name}: {script}"
        assert script.rstrip().endswith(f"exec baton {name.replace('_', '-')}"), f"{name}: {script}"
    assert services["router"]["ports"] == ["8000:8000"]
    assert services["router"]["command"] == ["router"]


def test_every_service_has_a_health_check_on_its_real_endpoint() -> None:
    services = load_compose(REQUIRED)["services"]
    for name, prefix in BATON_SERVICES.items():
        test = services[name]["healthcheck"]["test"]
        if name == "router":
            assert f"os.environ['{prefix}PORT']" in " ".join(test) and "/health" in " ".join(test), test
            continue
        # the image's check: the service's own port and, under mtls.yml, its own certificate
        assert test == ["CMD", "python", "-m", "shared.cli.healthcheck_cmd", name.replace("_", "-")], test
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_ports_are_exposed_and_variables_name_real_settings() -> None:
    services = load_compose(REQUIRED)["services"]
    for name, prefix in BATON_SERVICES.items():
        env = service_environment(services[name])
        assert not unknown_baton_variables(env), f"{name}: {unknown_baton_variables(env)}"
        assert all(k.startswith(prefix) or k.startswith("OTEL_") for k in env), name
        assert env["OTEL_SERVICE_NAME"] == f"baton-{name.replace('_', '-')}"
        ports = {v for k, v in env.items() if k.endswith("_PORT")}
        assert ports <= set(services[name]["expose"]), f"{name}: {ports} not all in expose"
        settings = parse_for_service(prefix, env)  # every value parses
        assert settings.host == "0.0.0.0"  # type: ignore[attr-defined]
        redis_url = env[f"{prefix}REDIS_URL"]
        assert redis_url == "redis://redis:6379/0", name


def test_stop_grace_periods_cover_each_services_drain() -> None:
    services = load_compose(REQUIRED)["services"]
    for name, prefix in BATON_SERVICES.items():
        env = service_environment(services[name])
        grace_s = float(env[f"{prefix}SHUTDOWN_GRACE_S"])
        stop_s = float(services[name]["stop_grace_period"].removesuffix("s"))
        assert stop_s >= grace_s + 5, f"{name}: stop_grace_period {stop_s}s < drain {grace_s}s + 5s"


def test_otel_profile_runs_a_collector_that_the_services_point_at() -> None:
    compose = load_compose(VARIABLE_SETS["otel"])
    collector = compose["services"]["otel-collector"]
    assert collector["profiles"] == ["otel"]
    assert collector["image"].startswith("otel/opentelemetry-collector:")
    config_path = (COMPOSE_FILE.parent / collector["volumes"][0].split(":")[0]).resolve()
    config = yaml.safe_load(config_path.read_text())
    assert config["service"]["pipelines"]["traces"]["receivers"] == ["otlp"]
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    for name in BATON_SERVICES:
        env = service_environment(compose["services"][name])
        assert env["OTEL_SDK_DISABLED"] == "false"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
    for name in BATON_SERVICES:  # tracing is off without the profile
        assert service_environment(load_compose(REQUIRED)["services"][name])["OTEL_SDK_DISABLED"] == "true"


def test_the_internal_token_is_required_and_reaches_every_service() -> None:
    with pytest.raises(InterpolationError, match="BATON_INTERNAL_TOKEN"):
        load_compose({})
    services = load_compose(REQUIRED)["services"]
    for name, prefix in BATON_SERVICES.items():
        assert service_environment(services[name])[f"{prefix}INTERNAL_TOKEN"] == "stack-secret", name


def test_the_mtls_overlay_mounts_the_certificates_into_every_service(tmp_path: Any) -> None:
    with pytest.raises(InterpolationError, match="BATON_TLS_DIR"):
        load_compose({}, MTLS_FILE)
    services = load_compose({"BATON_TLS_DIR": str(tmp_path)}, MTLS_FILE)["services"]
    assert set(services) == set(BATON_SERVICES)
    for name, prefix in BATON_SERVICES.items():
        env = service_environment(services[name])
        assert env == {f"{prefix}TLS_DIR": "/etc/baton/tls"}
        assert not unknown_baton_variables(env), name
        assert services[name]["volumes"] == [f"{tmp_path}:/etc/baton/tls:ro"]


EPD_FILE = REPO_ROOT / "deploy" / "compose" / "epd.yml"
EPD_MTLS_FILE = REPO_ROOT / "deploy" / "compose" / "epd-mtls.yml"


@pytest.mark.parametrize("variables", list(VARIABLE_SETS), ids=list(VARIABLE_SETS))
def test_the_epd_overlay_adds_a_scalable_encoder_like_the_other_services(variables: str) -> None:
    """epd.yml: an encoder service valid under the Compose schema, scaled like prefill (no host port, its own
    hostname advertised), checked by the image's health check, its variables real settings, serving the
    stack's model and image, draining within its stop grace period; epd-mtls.yml gives it its certificate."""
    jsonschema = require_module("jsonschema", "jsonschema")
    schema = _compose_schema()
    overlay = load_compose(VARIABLE_SETS[variables], EPD_FILE)
    validator_cls = jsonschema.validators.validator_for(schema)
    assert not [e.message for e in validator_cls(schema).iter_errors(overlay)]
    main = load_compose(VARIABLE_SETS[variables])["services"]
    svc = overlay["services"]["encoder"]
    assert "ports" not in svc and "container_name" not in svc and "hostname" not in svc
    script = " ".join([*svc["entrypoint"], *svc["command"]])
    assert re.search(r"\bBATON_ENCODER_ADVERTISE_HOST=\$\{BATON_ENCODER_ADVERTISE_HOST:-\$\(hostname\)\}", script)
    assert script.rstrip().endswith("exec baton encoder")
    assert svc["healthcheck"]["test"] == ["CMD", "python", "-m", "shared.cli.healthcheck_cmd", "encoder"]
    assert svc["image"] == main["prefill"]["image"] and svc["build"] == main["prefill"]["build"]
    env = service_environment(svc)
    assert not unknown_baton_variables(env) and all(k.startswith(("BATON_ENCODER_", "OTEL_")) for k in env)
    settings: Any = parse_for_service("BATON_ENCODER_", env)
    assert settings.host == "0.0.0.0" and env["BATON_ENCODER_REDIS_URL"] == "redis://redis:6379/0"
    prefill_env = service_environment(main["prefill"])
    for field in ("MODEL", "DEVICE", "DTYPE"):  # its outputs are keyed by the model and the towers' dtype
        assert env[f"BATON_ENCODER_{field}"] == prefill_env[f"BATON_PREFILL_{field}"], field
    assert {v for k, v in env.items() if k.endswith("_PORT")} <= set(svc["expose"])
    assert float(svc["stop_grace_period"].removesuffix("s")) >= float(env["BATON_ENCODER_SHUTDOWN_GRACE_S"]) + 5
    with pytest.raises(InterpolationError, match="BATON_INTERNAL_TOKEN"):
        load_compose({}, EPD_FILE)
    tls = load_compose({"BATON_TLS_DIR": "/certs"}, EPD_MTLS_FILE)["services"]["encoder"]
    assert service_environment(tls) == {"BATON_ENCODER_TLS_DIR": "/etc/baton/tls"}
    assert tls["volumes"] == ["/certs:/etc/baton/tls:ro"]
