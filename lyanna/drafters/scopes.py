"""Profiler scope names of one draft step, shared by every drafter so that
``bench.drafter_breakdown`` can split draft time into layer forward, LM head, softmax and an
info_copy drafter's read of the context (the rest is sampling and tree bookkeeping).
``scope`` opens a ``record_function`` only while a profiler runs: entering one costs 3-6 us
even with no profiler, and a draft step opens several."""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

LAYER_SCOPE = "draft.layer"
LM_HEAD_SCOPE = "draft.lm_head"
SOFTMAX_SCOPE = "draft.softmax"
SAMPLE_SCOPE = "draft.sample"
COPY_SCOPE = "draft.copy_read"  # an info_copy drafter's attention read of the context

_NO_SCOPE = contextlib.nullcontext()


def scope(name: str) -> contextlib.AbstractContextManager:
    """``record_function(name)`` under a profiler, else a shared no-op context."""
    return record_function(name) if torch.autograd._profiler_enabled() else _NO_SCOPE
