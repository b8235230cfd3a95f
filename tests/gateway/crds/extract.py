"""Vendor the ``openAPIV3Schema`` of prometheus-operator CRDs (README.md beside this file):

    python -m tests.gateway.crds.extract URL_OR_PATH...

Each argument is a CRD manifest (a path, ``-`` for stdin, or an ``https://`` URL); the schema
of its ``v1`` version is written, as it stands, to ``tests/gateway/crds/<kind>.schema.json``
(the kind in lower case; JSON with sorted keys, so a refresh diffs by field)."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
VERSION = "v1"  # the only version of monitoring.coreos.com the manifests use


def read(source: str) -> str:
    if source == "-":
        return sys.stdin.read()
    if source.startswith("https://"):
        with urllib.request.urlopen(source, timeout=60) as response:
            return response.read().decode()
    return Path(source).read_text()


def extract(manifest: str) -> tuple[str, dict]:
    """The CRD's kind and its ``v1`` schema (a served version, or the check is moot)."""
    crd = yaml.safe_load(manifest)
    assert crd["kind"] == "CustomResourceDefinition", crd["kind"]
    (version,) = (v for v in crd["spec"]["versions"] if v["name"] == VERSION)
    assert version["served"], f"{crd['metadata']['name']}: {VERSION} is not served"
    return crd["spec"]["names"]["kind"], version["schema"]["openAPIV3Schema"]


def main(sources: list[str]) -> None:
    for source in sources:
        kind, schema = extract(read(source))
        path = HERE / f"{kind.lower()}.schema.json"
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        print(f"{path}: {kind} {VERSION} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main(sys.argv[1:] or ["-"])
