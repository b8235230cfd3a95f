"""The prometheus-operator's own CRD schemas (vendored verbatim, README.md) as a check of the
operator objects our manifests hold, with the API server's semantics:

- ``validator(kind)`` validates against the CRD's ``openAPIV3Schema`` translated to JSON
  Schema (draft 4, which OpenAPI 3.0 follows): ``x-kubernetes-int-or-string`` (and
  ``format: int-or-string``) becomes ``anyOf`` integer / string, ``nullable`` admits null,
  an object closes (``additionalProperties: false``) unless the schema gives
  ``additionalProperties`` or ``x-kubernetes-preserve-unknown-fields``, a ``set`` list refuses
  duplicates, a ``map`` list refuses two items with the same keys, RE2 patterns run in
  Python's ``re``. Any other ``x-kubernetes-*`` extension (CEL validations, embedded
  resources) raises, so a refreshed CRD cannot slip a rule past the check unread.
- ``pruned(doc)`` names every field the API server would drop without a word (a structural
  schema prunes unknown fields and non-nullable nulls instead of refusing them): a misspelt
  field must fail here even where the closed JSON Schema would not say why.
- ``problems(doc)`` is both, plus the object's ``metadata`` against the Kubernetes
  ObjectMeta schema in strict mode (the CRD leaves ``metadata`` to the API server)."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate

HERE = Path(__file__).resolve().parent
API_VERSION = "monitoring.coreos.com/v1"
# extensions that only steer merges (server-side apply) or defaults: nothing to validate
INERT = {"x-kubernetes-map-type", "x-kubernetes-list-type", "default", "description"}
TRANSLATED = {
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-list-map-keys",  # a keyword of Validator below
}
INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]


def schema_path(kind: str) -> Path:
    return HERE / f"{kind.lower()}.schema.json"


def crd_schema(kind: str) -> dict[str, Any]:
    """The vendored ``openAPIV3Schema`` of ``kind`` (``ServiceMonitor``, ...)."""
    return json.loads(schema_path(kind).read_text())


def _pattern(pattern: str) -> str:
    """An RE2 pattern as Python's ``re`` reads it: RE2 takes flags after ``^``
    (``^(?i)(abort|warn)?$``), Python only at the start (same meaning: ``^`` has no case)."""
    pattern = re.sub(r"^\^\(\?([ims]+)\)", r"(?\1)^", pattern)
    re.compile(pattern)  # refuses what it cannot read, rather than match something else
    return pattern


def json_schema(node: dict[str, Any], root: bool = False) -> dict[str, Any]:
    """The structural schema ``node`` as JSON Schema with the API server's semantics."""
    unknown = {k for k in node if k.startswith("x-kubernetes-")} - INERT - TRANSLATED
    if unknown:
        raise NotImplementedError(f"no JSON Schema translation of {sorted(unknown)}")
    out = {k: v for k, v in node.items() if k not in INERT}
    if node.get("x-kubernetes-int-or-string") or node.get("format") == "int-or-string":
        for key in ("type", "format", "x-kubernetes-int-or-string"):
            out.pop(key, None)
        out["anyOf"] = INT_OR_STRING
    if "pattern" in out:
        out["pattern"] = _pattern(out["pattern"])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out and out[key] is not INT_OR_STRING:
            out[key] = [json_schema(sub) for sub in out[key]]
    if "not" in out:
        out["not"] = json_schema(out["not"])
    if "items" in out:
        out["items"] = json_schema(out["items"])
    if node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    if "properties" in out:
        out["properties"] = {name: json_schema(sub) for name, sub in out["properties"].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = json_schema(out["additionalProperties"])
    if node.get("type") == "object" and not node.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)  # no properties either: all pruned
    if out.pop("nullable", False):
        if "type" in out:
            out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
        if out.get("anyOf") is INT_OR_STRING:
            out["anyOf"] = [*INT_OR_STRING, {"type": "null"}]
    if root:  # metadata is the API server's ObjectMeta, checked on its own in problems()
        out["properties"]["metadata"] = {"type": "object"}
    return out


def _unique_list_map_keys(validator, keys, instance, schema):
    """``x-kubernetes-list-type: map``: one item per combination of the key fields."""
    if not validator.is_type(instance, "array"):
        return
    seen = set()
    for item in instance:
        if not isinstance(item, dict):
            continue
        key = json.dumps([item.get(k) for k in keys])
        if key in seen:
            yield jsonschema.ValidationError(
                f"duplicate entry for key {dict(zip(keys, json.loads(key), strict=True))}"
            )
        seen.add(key)


Validator = jsonschema.validators.extend(
    jsonschema.Draft4Validator, {"x-kubernetes-list-map-keys": _unique_list_map_keys}
)


@cache
def validator(kind: str) -> jsonschema.protocols.Validator:
    schema = json_schema(crd_schema(kind), root=True)
    Validator.check_schema(schema)
    return Validator(schema, format_checker=Validator.FORMAT_CHECKER)


def _pruned(value: Any, node: dict[str, Any], path: str) -> list[str]:
    if value is None:
        return [] if node.get("nullable") else [f"{path} (null)"]
    found = []
    if isinstance(value, dict):
        properties = node.get("properties", {})
        additional = node.get("additionalProperties")
        for key, sub in value.items():
            where = f"{path}.{key}"
            if key in properties:
                found += _pruned(sub, properties[key], where)
            elif isinstance(additional, dict):
                found += _pruned(sub, additional, where)
            elif not node.get("x-kubernetes-preserve-unknown-fields"):
                found.append(where)
    elif isinstance(value, list) and "items" in node:
        for i, item in enumerate(value):
            found += _pruned(item, node["items"], f"{path}[{i}]")
    return found


def pruned(doc: dict[str, Any]) -> list[str]:
    """The paths (``.spec.endpoints[0].intreval``) of the fields of ``doc`` the API server
    would prune under its kind's CRD (``metadata`` aside: ObjectMeta, see ``problems``)."""
    schema = crd_schema(doc["kind"])
    rest = {k: v for k, v in doc.items() if k != "metadata"}
    return _pruned(rest, schema, "")


def problems(doc: dict[str, Any], k8s_version: str) -> list[str]:
    """Everything the API server (``k8s_version``'s ObjectMeta) would refuse or drop in
    ``doc``, an object of a vendored kind; empty when it would store it as written."""
    if doc.get("apiVersion") != API_VERSION or not schema_path(doc.get("kind", "")).is_file():
        return [f"no vendored CRD schema of {doc.get('apiVersion')} {doc.get('kind')}"]
    found = [
        f"{e.json_path}: {e.message}"
        for e in sorted(validator(doc["kind"]).iter_errors(doc), key=lambda e: e.json_path)
    ]
    found += [f"{path}: pruned (not in the CRD schema)" for path in pruned(doc)]
    meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc.get("metadata")}
    try:
        kubernetes_validate.validate(meta, k8s_version, strict=True)
    except kubernetes_validate.ValidationError as error:
        found.append(f"$.metadata: {error.message}")
    return found
