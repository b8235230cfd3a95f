"""What the gateway exposes besides the API: the interactive docs and the OpenAPI schema are off
unless asked for (``LYANNA_OPENAPI=1``), and the deployment keeps ``/metrics`` to the
monitoring namespace (tests/gateway/test_deploy.py checks the NetworkPolicy)."""

from __future__ import annotations

import httpx
import pytest
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.server import free_port
from tests.gateway.conftest import MODEL_NAME
from tests.gateway.test_errors import RefusingBackend

PATHS = ("/docs", "/redoc", "/openapi.json")


@pytest.mark.parametrize("enabled", (False, True))
def test_docs_and_schema_only_when_enabled(enabled: bool, default_tokenizer) -> None:
    config = GatewayConfig.from_env({"LYANNA_OPENAPI": "1"} if enabled else {})
    assert config.openapi is enabled
    config = GatewayConfig(model_name=MODEL_NAME, openapi=config.openapi)
    app = create_app(RefusingBackend(RuntimeError("unused")), default_tokenizer, config)
    with TestClient(app) as client:
        for path in PATHS:
            status = client.get(path).status_code
            assert status == (200 if enabled else 404), (path, status)
        assert client.get("/v1/models").status_code == 200  # the API itself is unchanged
    assert "/v1/chat/completions" in app.openapi()["paths"]  # the schema, for tests and tools


def test_metrics_on_a_port_of_their_own(default_tokenizer) -> None:
    """``LYANNA_METRICS_PORT``: the registry is exported there (what the NetworkPolicy admits
    from the monitoring namespace only) and the API port no longer answers ``/metrics``."""
    port = free_port()
    config = GatewayConfig.from_env({"LYANNA_METRICS_PORT": str(port)}, model_name=MODEL_NAME)
    assert config.metrics_port == port
    app = create_app(RefusingBackend(RuntimeError("unused")), default_tokenizer, config)
    with TestClient(app) as client:
        assert client.get("/metrics").status_code == 404
        exported = httpx.get(f"http://{config.host}:{port}/metrics", timeout=10)
        assert exported.status_code == 200 and "lyanna_spec_draft_steps_total" in exported.text
    with pytest.raises(httpx.TransportError):  # stopped with the app
        httpx.get(f"http://{config.host}:{port}/metrics", timeout=2)
    default = create_app(
        RefusingBackend(RuntimeError("unused")), default_tokenizer, GatewayConfig()
    )
    with TestClient(default) as client:  # by default on the API port, as before
        assert "lyanna_spec_draft_steps_total" in client.get("/metrics").text


def test_the_metrics_port_needs_no_key_when_the_api_port_would(default_tokenizer) -> None:
    """``LYANNA_METRICS_NEED_KEY=1`` guards ``/metrics`` on the API port; Prometheus scrapes
    the metrics port (its ServiceMonitor sends no key), which the NetworkPolicy guards."""
    port = free_port()
    config = GatewayConfig(
        model_name=MODEL_NAME, api_keys=("k1",), metrics_need_key=True, metrics_port=port
    )
    app = create_app(RefusingBackend(RuntimeError("unused")), default_tokenizer, config)
    with TestClient(app) as client:
        assert client.get("/metrics").status_code == 401  # the API port: a key, then 404
        assert client.get("/metrics", headers={"Authorization": "Bearer k1"}).status_code == 404
        scraped = httpx.get(f"http://{config.host}:{port}/metrics", timeout=10)
        assert scraped.status_code == 200 and "lyanna_" in scraped.text
