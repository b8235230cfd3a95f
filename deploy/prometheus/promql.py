"""The PromQL definitions the recording rules (``deploy/prometheus/rules.py``) and the Grafana
dashboard (``deploy/grafana/dashboard.py``) share, so both compute each quantity one way.

Each takes ``rate``: how the caller turns a counter's name into a summed rate (the rules:
``sum by (method, model) (rate(x[5m]))``; the dashboard: its variables' label filters and
``$__rate_interval``).

Draft steps have vLLM's meaning (``docs/metrics.md``): ``lyanna_spec_draft_steps_total`` counts
verifications with at least one draft token, ``lyanna_spec_root_only_steps_total`` the others.
"""

from __future__ import annotations

from collections.abc import Callable

Rate = Callable[[str], str]

DRAFTS = "lyanna_spec_draft_steps_total"
ROOT_ONLY = "lyanna_spec_root_only_steps_total"
ACCEPTED = "lyanna_spec_accepted_tokens_total"


def acceptance_length(rate: Rate) -> str:
    """vLLM's mean acceptance length: 1 + accepted tokens / drafts. Root-only steps are left
    out (with drafting off it has no value rather than 1.0)."""
    return f"1 + {rate(ACCEPTED)} / ({rate(DRAFTS)} > 0)"


def verifications(rate: Rate) -> str:
    """Every verification of a request: drafts and root-only steps."""
    return f"({rate(DRAFTS)} + {rate(ROOT_ONLY)})"


def drafted_share(rate: Rate) -> str:
    """The share of verifications that verified a draft (how much drafting happens)."""
    return f"{rate(DRAFTS)} / {verifications(rate)}"


def fallback_share(rate: Rate) -> str:
    """The share of verifications the drafter service did not draft (the gateway verified
    them without it)."""
    return f"{rate('lyanna_spec_drafter_fallback_total')} / {verifications(rate)}"
