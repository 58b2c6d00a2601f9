"""Reading deploy/compose/docker-compose.yml the way `docker compose` does, without an engine.

    load_compose(path, variables) ─► interpolate every string (`${VAR:-default}`, `$$` ...)
                                   ─► {"services": {name: {...}}, ...} as compose would run it

Interpolation follows the Compose Specification: `$$` is a literal `$`; `${VAR}` and `$VAR`
are the variable (empty when unset); `${VAR:-d}` / `${VAR-d}` default when unset-or-empty /
unset; `${VAR:+a}` / `${VAR+a}` substitute when set-and-nonempty / set; `${VAR:?msg}` and
`${VAR?msg}` are errors when unset(-or-empty). Defaults may hold nested `${...}`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "deploy" / "compose" / "docker-compose.yml"
DOCKERFILE = REPO_ROOT / "deploy" / "docker" / "Dockerfile"

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class InterpolationError(ValueError):
    pass


def _closing_brace(text: str, start: int) -> int:
    """Index of the `}` closing the `${` whose body starts at `start` (nested `${...}` allowed)."""
    depth = 1
    i = start
    while i < len(text):
        if text.startswith("$$", i):
            i += 2
            continue
        if text.startswith("${", i):
            depth += 1
            i += 2
            continue
        if text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise InterpolationError(f"unterminated ${{ in {text!r}")


def _braced(body: str, variables: Mapping[str, str]) -> str:
    m = _NAME.match(body)
    if m is None:
        raise InterpolationError(f"bad variable reference ${{{body}}}")
    name, rest = m.group(0), body[m.end():]
    value = variables.get(name)
    if not rest:
        return value or ""
    for op in (":-", "-", ":+", "+", ":?", "?"):
        if rest.startswith(op):
            arg = interpolate(rest[len(op):], variables)
            break
    else:
        raise InterpolationError(f"bad operator in ${{{body}}}")
    set_nonempty, is_set = bool(value), value is not None
    if op == ":-":
        return value if set_nonempty else arg  # type: ignore[return-value]
    if op == "-":
        return value if is_set else arg  # type: ignore[return-value]
    if op == ":+":
        return arg if set_nonempty else ""
    if op == "+":
        return arg if is_set else ""
    if (op == ":?" and not set_nonempty) or (op == "?" and not is_set):
        raise InterpolationError(f"required variable {name} is missing: {arg}")
    return value or ""


def interpolate(text: str, variables: Mapping[str, str]) -> str:
    """One string with compose's variable syntax substituted."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("${", i):
            end = _closing_brace(text, i + 2)
            out.append(_braced(text[i + 2:end], variables))
            i = end + 1
        elif text[i] == "$" and (m := _NAME.match(text, i + 1)):
            out.append(variables.get(m.group(0)) or "")
            i = m.end()
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def interpolate_tree(node: Any, variables: Mapping[str, str]) -> Any:
    """Every string value of a loaded YAML tree interpolated (keys are left alone, as compose does)."""
    if isinstance(node, str):
        return interpolate(node, variables)
    if isinstance(node, list):
        return [interpolate_tree(v, variables) for v in node]
    if isinstance(node, dict):
        return {k: interpolate_tree(v, variables) for k, v in node.items()}
    return node


def load_compose(variables: Mapping[str, str] | None = None, path: Path = COMPOSE_FILE) -> dict[str, Any]:
    """The compose file after interpolation with `variables` (the shell or `.env` of a real run)."""
    raw = yaml.safe_load(path.read_text())
    return dict(interpolate_tree(raw, variables or {}))


def service_environment(service: Mapping[str, Any]) -> dict[str, str]:
    """A service's `environment`, map or list form, as strings (`KEY` alone in a list means unset)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        pairs = [item.split("=", 1) for item in env if "=" in item]
        return {k: v for k, v in pairs}
    return {k: "" if v is None else str(v).lower() if isinstance(v, bool) else str(v) for k, v in env.items()}


def dockerfile_entrypoint(path: Path = DOCKERFILE) -> list[str]:
    """The exec-form ENTRYPOINT of the Dockerfile's last stage."""
    import json

    entrypoint: list[str] | None = None
    for line in path.read_text().splitlines():
        if line.startswith("FROM "):
            entrypoint = None
        elif line.startswith("ENTRYPOINT "):
            entrypoint = json.loads(line[len("ENTRYPOINT "):])
    if entrypoint is None:
        raise ValueError(f"{path} has no exec-form ENTRYPOINT in its last stage")
    return entrypoint
