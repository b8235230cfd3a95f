"""The contract's constants (the quiet-step bound, the decode-step bound, the hop bound and
plain decoding's method name) are defined once, in the contract: the bounds are the proto enum
``Limit``'s values, ``services.codec`` hands them to Python, and the gateway and the services
import them from there instead of writing their own copies."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from remote_engine.config import RemoteConfig
from services import codec
from services.pb import common_pb2

ROOT = Path(__file__).resolve().parents[2]
CONSTANTS = ("MAX_QUIET_STEPS", "MAX_VERIFY_STEPS", "MAX_STEPS", "MAX_HOP_SECONDS", "TARGET_ONLY")
# where each is defined: the bounds in the codec (from the proto), the method name in the
# drafter registry (the core package imports nothing of the services), read by the codec
HOMES = {"services/codec.py", "lyanna/drafters/__init__.py"}


def module_level_definitions(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def test_the_bounds_are_the_proto_enums_values() -> None:
    limit = common_pb2.Limit
    assert codec.MAX_QUIET_STEPS == limit.Value("LIMIT_MAX_QUIET_STEPS") == 64
    assert codec.MAX_VERIFY_STEPS == limit.Value("LIMIT_MAX_VERIFY_STEPS") == 64
    assert codec.MAX_HOP_SECONDS == limit.Value("LIMIT_MAX_HOP_SECONDS") == 60.0
    assert codec.TARGET_ONLY == "ar"


def test_no_side_defines_its_own_copy() -> None:
    copies = sorted(
        f"{path.relative_to(ROOT)}: {name}"
        for package in ("gateway", "services", "remote_engine", "lyanna", "bench", "loadtests")
        for path in (ROOT / package).rglob("*.py")
        if str(path.relative_to(ROOT)) not in HOMES and "pb" not in path.parent.name
        for name in module_level_definitions(path) & set(CONSTANTS)
    )
    assert not copies, copies
    homes = {p: module_level_definitions(ROOT / p) & set(CONSTANTS) for p in sorted(HOMES)}
    assert homes == {
        "lyanna/drafters/__init__.py": {"TARGET_ONLY"},
        "services/codec.py": {
            "MAX_QUIET_STEPS",
            "MAX_VERIFY_STEPS",
            "MAX_HOP_SECONDS",
            "TARGET_ONLY",
        },
    }


def test_the_gateway_bounds_its_calls_by_the_verifiers_bound() -> None:
    assert RemoteConfig("v:1", max_steps_per_call=codec.MAX_VERIFY_STEPS).max_steps_per_call == 64
    with pytest.raises(ValueError, match=r"\[1, 64\]"):
        RemoteConfig("v:1", max_steps_per_call=codec.MAX_VERIFY_STEPS + 1)
