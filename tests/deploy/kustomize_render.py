"""A small kustomize: renders the kustomizations under deploy/k8s with no kustomize binary.

    render(dir) ─ kustomization.yaml
      ├ resources: files (multi-document YAML) or directories (rendered recursively, first)
      ├ patches:   strategic-merge patches (`path:` or inline `patch:`), matched by kind + name
      ├ namespace: set on every namespaced resource
      ├ labels:    `pairs` added to metadata.labels (includeSelectors/includeTemplates: false)
      └ images:    name -> newName / newTag / digest, on every container and initContainer
    in kustomize's order: resources, patches, namespace, labels, images.

It handles exactly what those kustomizations use and raises on anything else (an unknown
field, a `$patch` directive, a JSON 6902 patch), so a new feature cannot pass unrendered.
Strategic merge follows the Kubernetes merge keys of the lists our patches touch. When a
`kubectl` binary is around, tests/deploy/test_k8s.py checks this against `kubectl kustomize`.

    python tests/deploy/kustomize_render.py deploy/k8s/overlays/gpu    # prints the YAML stream
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]

SUPPORTED_FIELDS = {"apiVersion", "kind", "namespace", "labels", "resources", "patches", "images"}
CLUSTER_SCOPED_KINDS = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume",
    "StorageClass", "PriorityClass", "IngressClass", "RuntimeClass", "ValidatingWebhookConfiguration",
    "MutatingWebhookConfiguration", "APIService",
}
# strategic-merge keys of the lists a patch may touch (k8s.io/api's patchMergeKey tags)
MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name", "env": "name",
    "volumes": "name", "volumeMounts": "mountPath", "volumeDevices": "devicePath", "imagePullSecrets": "name",
    "hostAliases": "ip", "topologySpreadConstraints": "topologyKey",
}
CONTAINER_PORT_KEY = "containerPort"  # ports of a container
SERVICE_PORT_KEY = "port"  # ports of a Service


class KustomizeError(ValueError):
    pass


def render(directory: Path | str) -> list[Resource]:
    """The resources a `kustomize build <directory>` would print (order: as listed)."""
    directory = Path(directory)
    kfile = directory / "kustomization.yaml"
    if not kfile.is_file():
        raise KustomizeError(f"{directory} has no kustomization.yaml")
    kust = yaml.safe_load(kfile.read_text()) or {}
    unknown = set(kust) - SUPPORTED_FIELDS
    if unknown:
        raise KustomizeError(f"{kfile}: unsupported fields {sorted(unknown)}")
    resources: list[Resource] = []
    for entry in kust.get("resources", []):
        path = (directory / entry).resolve()
        resources.extend(render(path) if path.is_dir() else _load_documents(path))
    _check_unique(resources, kfile)
    for patch in kust.get("patches", []):
        _apply_patch(resources, patch, directory)
    if "namespace" in kust:
        for r in resources:
            if r["kind"] not in CLUSTER_SCOPED_KINDS:
                r["metadata"]["namespace"] = kust["namespace"]
    for label in kust.get("labels", []):
        _apply_labels(resources, label)
    for image in kust.get("images", []):
        _apply_image(resources, image)
    return resources


def _load_documents(path: Path) -> list[Resource]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for d in docs:
        if not isinstance(d, dict) or not {"apiVersion", "kind", "metadata"} <= set(d):
            raise KustomizeError(f"{path}: not a Kubernetes resource: {str(d)[:80]}")
    return docs


def resource_id(r: Resource) -> tuple[str, str, str]:
    return r["kind"], r["metadata"].get("namespace", ""), r["metadata"]["name"]


def _check_unique(resources: list[Resource], where: Path) -> None:
    seen: set[tuple[str, str, str]] = set()
    for r in resources:
        rid = resource_id(r)
        if rid in seen:
            raise KustomizeError(f"{where}: resource {rid} listed twice")
        seen.add(rid)


# ---- patches --------------------------------------------------------------------------------------


def _apply_patch(resources: list[Resource], entry: dict[str, Any], directory: Path) -> None:
    unknown = set(entry) - {"path", "patch", "target"}
    if unknown or ("path" in entry) == ("patch" in entry):
        raise KustomizeError(f"patch entry needs exactly one of path/patch and may have target: {entry}")
    text = (directory / entry["path"]).read_text() if "path" in entry else entry["patch"]
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise KustomizeError(f"only single-document strategic-merge patches are supported: {entry}")
    patch = docs[0]
    targets = _patch_targets(resources, patch, entry.get("target"))
    if not targets:
        raise KustomizeError(f"patch {entry} matches no resource")
    for r in targets:
        body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
        if entry.get("target"):
            body.get("metadata", {}).pop("name", None)
        merged = strategic_merge(r, body, ())
        r.clear()
        r.update(merged)


def _patch_targets(resources: list[Resource], patch: Resource, target: dict[str, Any] | None) -> list[Resource]:
    if target is not None:
        unknown = set(target) - {"kind", "name", "namespace"}
        if unknown:
            raise KustomizeError(f"patch target selectors {sorted(unknown)} are not supported")
        want = target
    else:
        if "kind" not in patch or "name" not in patch.get("metadata", {}):
            raise KustomizeError("a patch without target needs kind and metadata.name")
        want = {"kind": patch["kind"], "name": patch["metadata"]["name"]}
        if "namespace" in patch["metadata"]:
            want["namespace"] = patch["metadata"]["namespace"]
    return [
        r for r in resources
        if r["kind"] == want.get("kind", r["kind"])
        and r["metadata"]["name"] == want.get("name", r["metadata"]["name"])
        and r["metadata"].get("namespace", "") == want.get("namespace", r["metadata"].get("namespace", ""))
    ]


def strategic_merge(base: Any, patch: Any, path: tuple[str, ...]) -> Any:
    """`patch` merged into `base`: maps recursively (null deletes), keyed lists by their merge key."""
    if isinstance(patch, dict):
        if any(k.startswith("$") for k in patch):
            raise KustomizeError(f"strategic-merge directives are not supported (at {'.'.join(path)})")
        out = copy.deepcopy(base) if isinstance(base, dict) else {}
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = strategic_merge(out.get(key), value, (*path, key))
        return out
    if isinstance(patch, list):
        key = _merge_key(path)
        if key is None or not isinstance(base, list):
            return copy.deepcopy(patch)  # lists without a merge key are replaced
        out_list = copy.deepcopy(base)
        for item in patch:
            match = next((i for i, b in enumerate(out_list) if b.get(key) == item.get(key)), None)
            if match is None:
                out_list.append(copy.deepcopy(item))
            else:
                out_list[match] = strategic_merge(out_list[match], item, path)
        return out_list
    return copy.deepcopy(patch)


def _merge_key(path: tuple[str, ...]) -> str | None:
    field = path[-1] if path else ""
    if field == "ports":
        parent = path[-2] if len(path) >= 2 else ""
        return CONTAINER_PORT_KEY if parent in ("containers", "initContainers") else SERVICE_PORT_KEY
    return MERGE_KEYS.get(field)


# ---- labels, images -------------------------------------------------------------------------------


def _apply_labels(resources: list[Resource], entry: dict[str, Any]) -> None:
    unknown = set(entry) - {"pairs", "includeSelectors", "includeTemplates"}
    if unknown or entry.get("includeSelectors") or entry.get("includeTemplates"):
        raise KustomizeError(f"labels: only `pairs` (no selectors/templates) is supported: {entry}")
    for r in resources:
        r["metadata"].setdefault("labels", {}).update(entry.get("pairs", {}))


def _pod_specs(r: Resource) -> Iterable[dict[str, Any]]:
    kind, spec = r["kind"], r.get("spec", {})
    if kind == "Pod":
        yield spec
    elif kind == "CronJob":
        yield spec["jobTemplate"]["spec"]["template"]["spec"]
    elif "template" in spec:
        yield spec["template"].get("spec", {})


def split_image(image: str) -> tuple[str, str, str]:
    """'repo/name:tag@sha256:..' -> (name, tag, digest), any part possibly empty."""
    name, _, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = ""
    if colon > slash:
        name, tag = name[:colon], name[colon + 1:]
    return name, tag, digest


def _apply_image(resources: list[Resource], entry: dict[str, Any]) -> None:
    unknown = set(entry) - {"name", "newName", "newTag", "digest"}
    if unknown:
        raise KustomizeError(f"images: unsupported fields {sorted(unknown)}")
    for r in resources:
        for pod in _pod_specs(r):
            for c in [*pod.get("initContainers", []), *pod.get("containers", [])]:
                name, tag, digest = split_image(c["image"])
                if name != entry["name"]:
                    continue
                name = entry.get("newName", name)
                if "digest" in entry:
                    c["image"] = f"{name}@{entry['digest']}"
                else:
                    tag = str(entry.get("newTag", tag))
                    c["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest and "newTag" not in entry else "")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: kustomize_render.py DIR", file=sys.stderr)
        return 2
    yaml.safe_dump_all(render(argv[0]), sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
