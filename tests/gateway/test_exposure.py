"""What the gateway exposes besides the API: the interactive docs and the OpenAPI schema are off
unless asked for (``LYANNA_OPENAPI=1``), and the deployment keeps ``/metrics`` to the
monitoring namespace (tests/gateway/test_deploy.py checks the NetworkPolicy)."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.config import GatewayConfig
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
