"""Profiler scope names of one draft step, shared by every drafter so that
``bench.drafter_breakdown`` can split draft time into layer forward, LM head and softmax (the
rest is sampling and tree bookkeeping). ``torch.profiler.record_function`` costs next to
nothing when no profiler is running."""

LAYER_SCOPE = "draft.layer"
LM_HEAD_SCOPE = "draft.lm_head"
SOFTMAX_SCOPE = "draft.softmax"
SAMPLE_SCOPE = "draft.sample"
