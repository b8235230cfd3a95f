"""Sampling parameters and the logits -> probabilities map shared by decoding and verification.

Every acceptance rule compares a target distribution with a draft distribution; both must pass
through exactly the same processing (temperature, top-p), so this module is the only place
that processing lives. Temperature 0 means greedy: the distribution is a one-hot on the argmax
(lowest index wins ties, like ``torch.argmax``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_STOP_STRINGS = 8


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request decoding parameters (OpenAI semantics)."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 128
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self) -> torch.Generator:
        """A CPU generator seeded from ``seed`` (or from OS entropy when no seed is given)."""
        gen = torch.Generator()
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def logits_to_probs(
    logits: torch.Tensor,  # [..., vocab]
    temperature: float,
    top_p: float = 1.0,
) -> torch.Tensor:  # [..., vocab] float32
    """Processed next-token distribution: one-hot argmax at temperature 0, else softmax(l/T)
    restricted to the top-p nucleus and renormalised."""
    logits = logits.float()
    if temperature == 0.0:
        probs = torch.zeros_like(logits)
        probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return probs
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        probs = _top_p_filter(probs, top_p)
    return probs


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    filtered = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return filtered / filtered.sum(dim=-1, keepdim=True)


def sample(
    probs: torch.Tensor,  # [n, vocab] float32, rows sum to 1
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # [n] int64
    """One token per row by inverse-CDF sampling with a single uniform per row."""
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64)
    cdf = probs.double().cumsum(dim=-1)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def greedy_or_sample(
    logits: torch.Tensor,  # [n, vocab]
    params: SamplingParams,
    generator: torch.Generator | None,
) -> torch.Tensor:  # [n] int64
    """The plain decoder's choice of next token for each row."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return sample(logits_to_probs(logits, params.temperature, params.top_p), generator)
