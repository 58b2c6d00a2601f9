"""The image, built for real by podman (tests/deploy/images.py): what it runs as, what it carries.

    non-root numeric user, a HEALTHCHECK (`baton healthcheck`), `baton` as the entrypoint
    no compiler in the runtime image, and the CPU kernels load anyway: prebuilt at image build for the
      baseline ISA, the instruction set picked at load
    its size, in the run's summary (tests/deploy/conftest.py) and deploy/README.md
    no stale build left behind: the previous builds' images pruned, the kernels stage kept cached
"""

from __future__ import annotations

import pytest

from shared.ops import cpu_isa
from tests.deploy.images import (
    BATON_IMAGE,
    BATON_LABEL,
    KERNELS_IMAGE,
    baton_image,
    image_exists,
    image_inspect,
    require_podman,
    run,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def image() -> str:
    require_podman()
    build = baton_image()
    assert build.size_bytes > 0
    return build.image


def _run_in(image: str, *argv: str, entrypoint: str = "python") -> str:
    result = run(["podman", "run", "--rm", "--network", "host", "--entrypoint", entrypoint, image, *argv],
                 timeout_s=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


def test_the_image_runs_baton_as_non_root_with_a_health_check(image: str) -> None:
    inspected = image_inspect(image)
    config = inspected["Config"]
    assert isinstance(config, dict)
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["baton"]
    health = inspected.get("Healthcheck")
    assert isinstance(health, dict) and health["Test"] == ["CMD", "python", "-m", "shared.cli.healthcheck_cmd"], config
    whoami = _run_in(image, "-c", "import os; print(os.getuid(), os.getgid())")
    assert whoami.split()[:2] == ["10001", "10001"]


def test_a_build_leaves_no_stale_image_and_keeps_the_kernels_stage(image: str) -> None:
    """CI builds on every run: untagged images of earlier builds once filled the disk (tests/deploy/images.py)."""
    stale = run(["podman", "images", "--quiet", "--filter", "dangling=true", "--filter", f"label={BATON_LABEL}"])
    assert stale.stdout.split() == []
    assert image_exists(KERNELS_IMAGE)
    assert image_inspect(image)["Config"]["Labels"]["io.baton.image"] == "baton"  # type: ignore[index]


def test_no_compiler_yet_the_cpu_kernels_load_prebuilt(image: str) -> None:
    compilers = run(["podman", "run", "--rm", "--entrypoint", "sh", image, "-c",
                     "command -v g++ || command -v gcc || command -v cc || command -v c++"], check=False)
    assert compilers.returncode != 0, f"a compiler in the runtime image: {compilers.stdout}"
    out = _run_in(image, "-c", "import logging, torch; logging.basicConfig(level=logging.INFO);"
                  "from shared.ops.cpu_kernels import cpu_kernels_available as ok; assert ok();"
                  "print('isa', torch.ops.baton_cpu.active_isa())")
    assert "CPU kernels: prebuilt" in out and "compil" not in out.lower(), out
    (isa_line,) = [line for line in out.splitlines() if line.startswith("isa ")]
    # the portable build holds every level's kernels: the container runs this CPU's best, as the host does
    assert isa_line.split()[1] == cpu_isa.best_isa(), isa_line


def test_the_healthcheck_names_what_is_wrong(image: str) -> None:
    """No service serving on the port: unhealthy, with the reason."""
    result = run(["podman", "run", "--rm", "--network", "host", "-e", "BATON_DECODE_PORT=1", image,
                  "healthcheck", "decode"], check=False, timeout_s=120)
    assert result.returncode == 1
    assert "decode unhealthy" in result.stderr, result.stderr


def test_baked_model_is_served_from_models(image: str) -> None:
    out = _run_in(image, "-c", "import os; print(sorted(os.listdir('/models/smollm2-135m')))")
    assert "config.json" in out and "model.safetensors" in out, out
    assert BATON_IMAGE in image
