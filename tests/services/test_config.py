"""Service configuration: flags beat environment variables beat defaults, each component gets
its own frozen dataclass, and invalid values are refused."""

from __future__ import annotations

import pytest

from services.config import ServerConfig, parse_configs
from services.drafter.server import DrafterConfig
from services.verifier.server import VerifierConfig


def test_flags_over_environment_over_defaults() -> None:
    env = {"LYANNA_VERIFIER_MAX_RUNNING": "4", "LYANNA_VERIFIER_PORT": "7000"}
    server, verifier = parse_configs(
        (ServerConfig, VerifierConfig),
        ["--port", "7001", "--rule", "tokenwise"],
        "LYANNA_VERIFIER_",
        env,
    )
    assert server.port == 7001 and verifier.max_running == 4 and verifier.rule == "tokenwise"
    assert server.max_message_bytes == 64 * 1024 * 1024 and verifier.max_len == 2048
    env = {"LYANNA_DRAFTER_TOP_K": "2", "LYANNA_DRAFTER_METHOD": "ngram"}
    _, drafter = parse_configs((ServerConfig, DrafterConfig), [], "LYANNA_DRAFTER_", env)
    assert drafter.method == "ngram" and drafter.shape().top_k == 2


@pytest.mark.parametrize(
    "argv",
    [["--method", "nope"], ["--depth", "0"], ["--plane", "mpi"], ["--port", "70000"]],
)
def test_invalid_values_are_refused(argv) -> None:
    with pytest.raises(SystemExit):
        parse_configs((ServerConfig, DrafterConfig), argv, "LYANNA_DRAFTER_", {})
