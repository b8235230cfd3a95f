"""Service configuration: flags beat environment variables beat defaults, each component gets
its own frozen dataclass, and invalid values are refused."""

from __future__ import annotations

import pytest

from services.config import ServerConfig, parse_configs
from services.drafter.server import DrafterConfig
from services.verifier.config import VerifierConfig


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


def test_the_drafter_service_announces_quiet_steps_unless_told_to_draft_ngram(monkeypatch):
    """Across a process boundary gated-off steps stay plain by default (quiet, verified in
    multi-step calls); ``--free-fallback true`` gives them the n-gram fallback."""
    import lyanna.drafters as drafters
    from lyanna.drafters.gate import GatedDrafter
    from lyanna.drafters.ngram import NgramDrafter
    from lyanna.tree_cost import VerifyCost
    from services.drafter.server import make_configured_drafter
    from tests.conftest import make_tiny_model

    registry = dict(drafters.DRAFTERS)
    registry["learned"] = lambda model, budget, capacity: NgramDrafter(budget)  # a stand-in
    monkeypatch.setattr(drafters, "DRAFTERS", registry)
    monkeypatch.setattr("services.drafter.config.DRAFTERS", registry)
    model = make_tiny_model(2, vocab_size=16)
    budget = drafters.DraftBudget(2, 1, 2, cost=VerifyCost((1, 2), (1.0, 1.5)))
    env = {"LYANNA_DRAFTER_METHOD": "learned"}
    _, plain = parse_configs((ServerConfig, DrafterConfig), [], "LYANNA_DRAFTER_", env)
    _, free = parse_configs(
        (ServerConfig, DrafterConfig), ["--free-fallback", "true"], "LYANNA_DRAFTER_", env
    )
    quiet = make_configured_drafter(plain, model, budget)
    drafting = make_configured_drafter(free, model, budget)
    assert isinstance(quiet, GatedDrafter) and not quiet.drafts_when_gated
    assert isinstance(drafting, GatedDrafter) and drafting.drafts_when_gated


def test_launched_services_thread_counts_follow_their_variables() -> None:
    """A flag beats its variable, so the launcher passes ``--torch-threads`` only where no
    variable should decide: the verifier's own default (every CPU) or variable applies, and
    the drafter gets one thread unless its variable is set."""
    from services.launch import thread_flags

    def verifier_threads(flags: list[str], env: dict[str, str]) -> int:
        server, _ = parse_configs((ServerConfig, VerifierConfig), flags, "LYANNA_VERIFIER_", env)
        return server.torch_threads

    env = {"LYANNA_VERIFIER_TORCH_THREADS": "3"}
    flags = thread_flags(None, env)
    assert verifier_threads(flags["verifier"], env) == 3
    assert verifier_threads(thread_flags(None, {})["verifier"], {}) == 0  # every CPU
    assert flags["drafter"] == ["--torch-threads", "1"]
    env = {"LYANNA_DRAFTER_TORCH_THREADS": "2"}
    server, _ = parse_configs(
        (ServerConfig, DrafterConfig), thread_flags(None, env)["drafter"], "LYANNA_DRAFTER_", env
    )
    assert server.torch_threads == 2
    both = ["--torch-threads", "4"]
    assert thread_flags(4, env) == {"verifier": both, "drafter": both}


def test_two_lanes_only_where_the_services_compute_apart() -> None:
    from remote_engine.config import use_pipeline

    assert not use_pipeline(None, remote=False, device="cpu")  # sharing this CPU's cores
    assert use_pipeline(None, remote=True, device="cpu")  # services elsewhere
    assert use_pipeline(None, remote=False, device="cuda")
    assert use_pipeline(True, remote=False, device="cpu")
    assert not use_pipeline(False, remote=True, device="cuda")


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--method", "ngram"], True),  # the verifier's free drafts draft the same trees
        (["--method", "lyanna"], False),  # a draft model: drafts here
        (["--method", "ngram", "--depth", "3"], False),  # a shape the verifier does not use
        (["--method", "ngram", "--tree", "fixed"], False),
        (["--method", "ngram", "--factory", "tests.services.tiny_drafters:slow_ngram"], False),
    ],
)
def test_only_a_default_ngram_drafter_lets_the_verifier_draft(argv, expected) -> None:
    _, drafter = parse_configs((ServerConfig, DrafterConfig), argv, "LYANNA_DRAFTER_", {})
    assert drafter.drafts_in_verifier is expected
