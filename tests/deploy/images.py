"""The images the container tests run, built for real with podman from an offline base.

    base_image()    Debian bookworm minbase (mmdebstrap) imported as BASE_IMAGE, once per machine
    fill_wheelhouse()   deploy/docker/wheelhouse from the host's pip (only what is missing)
    baton_image()   deploy/docker/Dockerfile (cached layers: a rebuild after a code change is the app layer)
    redis_image()   deploy/docker/redis.Dockerfile (Debian's redis-server)

No registry is reachable: the base comes from Debian's packages, pip installs from the wheelhouse,
and `podman build --network=host` lets apt reach Debian inside the build (docs/CONTAINERS.md).
Builds and their sizes are recorded in BUILDS, which the deploy conftest prints after the run.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.deploy.compose_file import DOCKERFILE, REPO_ROOT

BASE_IMAGE = "localhost/debian-minbase:bookworm"
BATON_IMAGE = "localhost/baton:test"
# the kernels stage, tagged so that pruning keeps its compile cached (it changes only with csrc/)
KERNELS_IMAGE = "localhost/baton-kernels:test"
# the Dockerfile's LABEL: every stage of a baton build carries it
BATON_LABEL = "io.baton.image=baton"
REDIS_IMAGE = "localhost/baton-redis:test"
# the test stack serves SmolLM2 only: baking Gemma 3 too would add a minute to every CI build
TEST_MODELS = "smollm2-135m"
BUILD_TIMEOUT_S = 1500.0
CONTAINERS_CONF = Path("/etc/containers/containers.conf")


@dataclass
class Build:
    image: str
    seconds: float
    size_bytes: int


BUILDS: list[Build] = []


def run(argv: list[str], timeout_s: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout[-4000:]}\n"
                             f"{result.stderr[-4000:]}")
    return result


def require_podman() -> str:
    """podman, configured as docs/CONTAINERS.md says (`make container-deps` does both): else fail."""
    podman = shutil.which("podman")
    if podman is None:
        pytest.fail("podman is not installed: make container-deps (apt-get install podman runc mmdebstrap)",
                    pytrace=False)
    if not CONTAINERS_CONF.is_file() or "runc" not in CONTAINERS_CONF.read_text():
        pytest.fail(f"{CONTAINERS_CONF} does not select runc: make container-deps writes it", pytrace=False)
    return podman


def image_exists(name: str) -> bool:
    return run(["podman", "image", "exists", name], check=False).returncode == 0


def image_size_bytes(name: str) -> int:
    return int(run(["podman", "image", "inspect", "--format", "{{.Size}}", name]).stdout.strip())


def base_image() -> str:
    """The offline base: mmdebstrap's minbase bookworm, imported once per machine."""
    if not image_exists(BASE_IMAGE):
        if shutil.which("mmdebstrap") is None:
            pytest.fail("mmdebstrap is not installed: make container-deps", pytrace=False)
        with_tar = Path(run(["mktemp", "-d"]).stdout.strip())
        try:
            tar = with_tar / "rootfs.tar"
            run(["mmdebstrap", "--variant=minbase", "--quiet", "bookworm", str(tar)], timeout_s=600)
            run(["podman", "import", "--quiet", str(tar), BASE_IMAGE], timeout_s=300)
        finally:
            shutil.rmtree(with_tar, ignore_errors=True)
    return BASE_IMAGE


def fill_wheelhouse() -> None:
    run([sys.executable, str(DOCKERFILE.with_name("wheelhouse.py")), "--models", *TEST_MODELS.split()],
        timeout_s=900)


def _build_argv(image: str, dockerfile: Path, context: Path, build_args: dict[str, str],
                target: str | None = None) -> list[str]:
    # --force-rm: a failed build leaves no working container behind (86 of them, from builds killed or out
    # of disk, held 27 GB here)
    argv = ["podman", "build", "--format", "docker", "--network=host", "--layers", "--force-rm", "-f",
            str(dockerfile), "-t", image]
    if target is not None:
        argv += ["--target", target]
    for key, value in build_args.items():
        argv += ["--build-arg", f"{key}={value}"]
    return [*argv, str(context)]


def _build(image: str, dockerfile: Path, context: Path, build_args: dict[str, str]) -> Build:
    t0 = time.monotonic()
    run(_build_argv(image, dockerfile, context, build_args), timeout_s=BUILD_TIMEOUT_S)
    build = Build(image, time.monotonic() - t0, image_size_bytes(image))
    BUILDS.append(build)
    return build


def prune_stale_baton_images() -> None:
    """Every code change leaves the previous app, models and runtime images untagged (a GiB and more
    each): on a machine that builds many times (CI) they filled the disk. Pruned by the Dockerfile's
    label, so no other project's images are touched; the tagged images and their layers stay cached."""
    run(["podman", "image", "prune", "--force", "--filter", f"label={BATON_LABEL}"], timeout_s=300)


@functools.cache
def baton_image() -> Build:
    """Built once per test session (every container test runs this very image)."""
    fill_wheelhouse()
    build_args = {"BASE_IMAGE": base_image(), "BATON_MODELS": TEST_MODELS}
    build = _build(BATON_IMAGE, DOCKERFILE, REPO_ROOT, build_args)
    # all cached by now: it only names the stage the prune would otherwise drop
    run(_build_argv(KERNELS_IMAGE, DOCKERFILE, REPO_ROOT, build_args, target="kernels"), timeout_s=BUILD_TIMEOUT_S)
    prune_stale_baton_images()
    return build


@functools.cache
def redis_image() -> Build:
    dockerfile = DOCKERFILE.with_name("redis.Dockerfile")
    return _build(REDIS_IMAGE, dockerfile, dockerfile.parent, {"BASE_IMAGE": base_image()})


def image_inspect(image: str) -> dict[str, object]:
    """`podman image inspect`: Config (user, entrypoint, ...) and, beside it, Healthcheck."""
    (inspected,) = json.loads(run(["podman", "image", "inspect", image]).stdout)
    return dict(inspected)
