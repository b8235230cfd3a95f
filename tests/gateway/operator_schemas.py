"""The Prometheus operator's ServiceMonitor and PrometheusRule (monitoring.coreos.com/v1), as
JSON schemas of the fields these manifests may use, written from the operator's API reference
(its CRDs cannot be vendored here). Stricter than the CRDs on purpose: an unknown field is
an error (a misspelt ``intreval`` would be silently pruned by the API server), durations and
label-selector operators follow the CRDs' own patterns and enums."""

from __future__ import annotations

from typing import Any

# monitoring.coreos.com/v1 Duration
DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
    r"(([0-9]+)ms)?)$",
}
STRING = {"type": "string"}
NAME = {"type": "string", "minLength": 1}
STRINGS = {"type": "array", "items": STRING}
STRING_MAP = {"type": "object", "additionalProperties": STRING}


def closed(required: tuple[str, ...] = (), **properties: Any) -> dict[str, Any]:
    """An object with these properties only (what the API server would prune is refused)."""
    schema = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = list(required)
    return schema


def resource(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    metadata = closed(
        ("name",), name=NAME, namespace=STRING, labels=STRING_MAP, annotations=STRING_MAP
    )
    return closed(
        ("apiVersion", "kind", "metadata", "spec"),
        apiVersion={"const": "monitoring.coreos.com/v1"},
        kind={"const": kind},
        metadata=metadata,
        spec=spec,
    )


LABEL_SELECTOR = closed(
    matchLabels=STRING_MAP,
    matchExpressions={
        "type": "array",
        "items": closed(
            ("key", "operator"),
            key=STRING,
            operator={"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
            values=STRINGS,
        ),
    },
)
ENDPOINT = closed(
    port=STRING,
    targetPort={"type": ["string", "integer"]},
    path=STRING,
    scheme={"enum": ["http", "https", "HTTP", "HTTPS"]},
    interval=DURATION,
    scrapeTimeout=DURATION,
    honorLabels={"type": "boolean"},
    params={"type": "object"},
)
SERVICE_MONITOR = resource(
    "ServiceMonitor",
    closed(
        ("selector", "endpoints"),
        selector=LABEL_SELECTOR,
        namespaceSelector=closed(any={"type": "boolean"}, matchNames=STRINGS),
        endpoints={"type": "array", "minItems": 1, "items": ENDPOINT},
        jobLabel=STRING,
    ),
)
RULE = {
    **closed(
        ("expr",),
        record=NAME,
        alert=NAME,
        expr={"type": ["string", "integer"]},
        keep_firing_for=DURATION,
        labels=STRING_MAP,
        annotations=STRING_MAP,
        **{"for": DURATION},
    ),
    "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
}
GROUP = closed(
    ("name",),
    name=NAME,
    interval=DURATION,
    limit={"type": "integer"},
    partial_response_strategy=STRING,
    rules={"type": "array", "items": RULE},
)
PROMETHEUS_RULE = resource("PrometheusRule", closed(groups={"type": "array", "items": GROUP}))
SCHEMAS = {"ServiceMonitor": SERVICE_MONITOR, "PrometheusRule": PROMETHEUS_RULE}
