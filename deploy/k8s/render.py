"""Render a kustomization the way ``kubectl kustomize`` does, for the features these manifests
use (so CI checks the composed objects without a kustomize binary):

- ``resources``: YAML files and directories holding a ``kustomization.yaml`` (recursively);
- ``namespace``: set on every namespaced object;
- ``labels`` with ``pairs`` (``includeSelectors: false``): added to every object's labels;
- ``images``: ``name`` -> ``newName`` / ``newTag`` / ``digest`` in (init) containers (an
  overlay of an overlay matches the names the inner one set);
- ``patches``: RFC 6902 JSON patches (a YAML list of operations in ``path``) applied to the
  objects their ``target`` (``kind`` and ``name``) selects.

    python -m deploy.k8s.render deploy/k8s/overlays/h800     # print the composed stream
"""

from __future__ import annotations

import sys
from pathlib import Path

import jsonpatch
import yaml

CLUSTER_SCOPED = frozenset({"Namespace", "PersistentVolume", "ClusterRole", "StorageClass"})


def _kustomization(directory: Path) -> dict:
    return yaml.safe_load((directory / "kustomization.yaml").read_text()) or {}


def _load(path: Path) -> list[dict]:
    if path.is_dir():
        return render(path)
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _split_image(reference: str) -> tuple[str, str]:
    """``reference`` as its name and its ``:tag`` / ``@digest`` suffix (a registry's
    ``host:port`` stays in the name)."""
    name, at, digest = reference.partition("@")
    head, _, tag = name.rpartition(":")
    if head and "/" not in tag:
        return head, f":{tag}{at}{digest}"
    return name, f"{at}{digest}"


def _set_image(container: dict, images: list[dict]) -> None:
    name, suffix = _split_image(container["image"])
    for image in images:
        if image["name"] != name:
            continue
        reference = image.get("newName", name)
        if "digest" in image:
            reference += f"@{image['digest']}"
        elif "newTag" in image:
            reference += f":{image['newTag']}"
        else:  # a new name only: the tag or digest stays, as kustomize keeps it
            reference += suffix
        container["image"] = reference


def _pod_spec(doc: dict) -> dict | None:
    spec = doc.get("spec", {})
    if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return spec.get("template", {}).get("spec")
    return None


def render(directory: str | Path) -> list[dict]:
    """The objects the kustomization in ``directory`` produces, in resource order."""
    directory = Path(directory)
    config = _kustomization(directory)
    docs = [doc for resource in config.get("resources", []) for doc in _load(directory / resource)]
    for patch in config.get("patches", []):
        target = patch["target"]
        operations = yaml.safe_load((directory / patch["path"]).read_text())
        matched = [
            i
            for i, doc in enumerate(docs)
            if doc["kind"] == target["kind"] and doc["metadata"]["name"] == target["name"]
        ]
        if not matched:
            raise ValueError(f"patch {patch['path']} matches no object")
        for i in matched:
            docs[i] = jsonpatch.apply_patch(docs[i], operations)
    for doc in docs:
        if "namespace" in config and doc["kind"] not in CLUSTER_SCOPED:
            doc["metadata"]["namespace"] = config["namespace"]
        for label_set in config.get("labels", []):
            if label_set.get("includeSelectors"):
                raise ValueError("labels with includeSelectors are not supported here")
            doc["metadata"].setdefault("labels", {}).update(label_set["pairs"])
        pod = _pod_spec(doc)
        if pod is not None:
            for container in (*pod.get("initContainers", []), *pod.get("containers", [])):
                _set_image(container, config.get("images", []))
    return docs


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(yaml.safe_dump_all(render(args[0]), sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
