"""Wire codecs between core objects and ``services.pb`` messages, with strict validation.

Tensors travel as raw little-endian bytes plus dtype and shape, never pickled: decoding checks
the dtype against a whitelist, the rank and element count against bounds and the byte length
against the shape before a single byte becomes a tensor. Token trees travel as tokens and
parent pointers (``TokenTree.__post_init__`` re-checks the structure); every malformed message
raises ``WireError`` (a ``ValueError``), which the servicers map to INVALID_ARGUMENT.

This module is the gRPC edge: each servicer decodes its request here first (``decode_prefill``,
``decode_verify``, ``decode_start``, ``decode_step``), before any lock, compute job or model
call. Past it the servicers check only state (an unknown sequence, a committed length that
disagrees) and the core asserts invariants.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

import lyanna.drafters
from lyanna.drafters.base import VerifiedStep
from lyanna.sampling import SamplingParams, TokenLogprob
from lyanna.tree import DraftScheme, TokenTree
from services.pb import common_pb2, verifier_pb2

if sys.byteorder != "little":
    raise ImportError("the tensor wire format is little-endian; big-endian hosts need a byteswap")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "bool": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

SCHEMES: dict[DraftScheme, int] = {
    DraftScheme.CHAIN_SAMPLED: common_pb2.DRAFT_SCHEME_CHAIN_SAMPLED,
    DraftScheme.IID: common_pb2.DRAFT_SCHEME_IID,
    DraftScheme.WITHOUT_REPLACEMENT: common_pb2.DRAFT_SCHEME_WITHOUT_REPLACEMENT,
    DraftScheme.TOPK: common_pb2.DRAFT_SCHEME_TOPK,
}
SCHEMES_BY_WIRE = {wire: scheme for scheme, wire in SCHEMES.items()}

# The contract's constants, defined once for both sides (the gateway and the services import
# them from here). proto3 has no constants: the bounds are the proto enum ``Limit``'s values.
MAX_QUIET_STEPS: int = common_pb2.LIMIT_MAX_QUIET_STEPS  # StepItem.unseen; quiet_steps trusted
MAX_VERIFY_STEPS: int = common_pb2.LIMIT_MAX_VERIFY_STEPS  # VerifyItem.steps
MAX_HOP_SECONDS: float = float(common_pb2.LIMIT_MAX_HOP_SECONDS)  # caller_hop_seconds
# plain decoding's method name (the drafter registry's): its sequences never reach the drafter
# service (StepItem.draft false, or a Verify straight to the verifier)
TARGET_ONLY: str = lyanna.drafters.TARGET_ONLY


class WireError(ValueError):
    """A message that does not decode to a valid object."""


@dataclass(frozen=True, slots=True)
class TensorLimits:
    max_elements: int = 1 << 26  # 256 MB of float32
    max_rank: int = 4

    def __post_init__(self) -> None:
        if self.max_elements < 1 or self.max_rank < 1:
            raise ValueError("tensor limits must be positive")


DEFAULT_LIMITS = TensorLimits()


def encode_tensor(tensor: torch.Tensor) -> common_pb2.Tensor:
    if tensor.dtype not in DTYPE_NAMES:
        raise WireError(f"dtype {tensor.dtype} cannot travel; allowed: {sorted(DTYPES)}")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return common_pb2.Tensor(dtype=DTYPE_NAMES[tensor.dtype], shape=list(tensor.shape), data=data)


def decode_tensor(
    message: common_pb2.Tensor,
    limits: TensorLimits = DEFAULT_LIMITS,
    dtype: torch.dtype | None = None,  # the dtype the caller requires, if any
) -> torch.Tensor:
    if message.dtype not in DTYPES:
        raise WireError(f"tensor dtype {message.dtype!r} is not allowed; allowed: {sorted(DTYPES)}")
    wire_dtype = DTYPES[message.dtype]
    if dtype is not None and wire_dtype != dtype:
        raise WireError(f"expected a {DTYPE_NAMES.get(dtype, dtype)} tensor, got {message.dtype}")
    shape = list(message.shape)
    if len(shape) > limits.max_rank or any(d < 0 for d in shape):
        raise WireError(f"tensor shape {shape} is invalid (rank <= {limits.max_rank}, dims >= 0)")
    numel = 1
    for d in shape:
        numel *= d
        if numel > limits.max_elements:
            raise WireError(f"tensor shape {shape} exceeds {limits.max_elements} elements")
    itemsize = torch.empty((), dtype=wire_dtype).element_size()
    if len(message.data) != numel * itemsize:
        raise WireError(
            f"tensor of shape {shape} and dtype {message.dtype} needs {numel * itemsize} bytes, "
            f"got {len(message.data)}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=wire_dtype)
    raw = torch.frombuffer(bytearray(message.data), dtype=torch.uint8)
    return raw.view(wire_dtype).reshape(shape)


def encode_tree(tree: TokenTree, with_draft_probs: bool = False) -> common_pb2.TokenTree:
    """Tokens, parents, scheme and the per-node draft probabilities (they rank nodes when
    trees are pruned or fused); the draft rows only with ``with_draft_probs``."""
    message = common_pb2.TokenTree(
        tokens=tree.tokens.tolist(), parents=tree.parents.tolist(), scheme=SCHEMES[tree.scheme]
    )
    if tree.draft_token_probs is not None:
        message.draft_token_probs.CopyFrom(encode_tensor(tree.draft_token_probs))
    if with_draft_probs and tree.draft_probs is not None:
        message.draft_probs.CopyFrom(encode_tensor(tree.draft_probs))
        if tree.vocab_index is not None:
            message.vocab_index.CopyFrom(encode_tensor(tree.vocab_index))
    return message


def root_only_tree(token: int) -> common_pb2.TokenTree:
    """No draft: verifying it is one step of plain decoding."""
    return common_pb2.TokenTree(tokens=[token], parents=[-1], scheme=common_pb2.DRAFT_SCHEME_TOPK)


def decode_tree(
    message: common_pb2.TokenTree,
    vocab_size: int,
    max_nodes: int,
    limits: TensorLimits = DEFAULT_LIMITS,
) -> TokenTree:
    tokens, parents = list(message.tokens), list(message.parents)
    if not 1 <= len(tokens) <= max_nodes or len(parents) != len(tokens):
        raise WireError(
            f"a tree needs 1..{max_nodes} tokens and one parent per token, got "
            f"{len(tokens)} tokens and {len(parents)} parents"
        )
    if any(not 0 <= t < vocab_size for t in tokens):
        raise WireError(f"tree token ids must be in [0, {vocab_size})")
    if message.scheme not in SCHEMES_BY_WIRE:
        raise WireError(f"unknown draft scheme {message.scheme}")

    def optional(field: str, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        if not message.HasField(field):
            return None
        return decode_tensor(getattr(message, field), limits, dtype)

    try:
        return TokenTree.from_parents(
            tokens,
            parents,
            scheme=SCHEMES_BY_WIRE[message.scheme],
            draft_token_probs=optional("draft_token_probs"),
            draft_probs=optional("draft_probs"),
            vocab_index=optional("vocab_index", torch.int64),
        )
    except ValueError as error:
        raise WireError(f"invalid tree: {error}") from None


def encode_params(params: SamplingParams) -> common_pb2.SamplingParams:
    message = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        max_tokens=params.max_tokens,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=dict(params.logit_bias),
        top_k=params.top_k,
    )
    if params.seed is not None:
        message.seed = params.seed
    if params.logprobs is not None:
        message.top_logprobs = params.logprobs
    return message


def encode_logprob(entry: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token=entry.token,
        logprob=entry.logprob,
        top_tokens=[t for t, _ in entry.top],
        top_logprobs=[lp for _, lp in entry.top],
    )


def decode_logprob(message: common_pb2.TokenLogprob) -> TokenLogprob:
    if len(message.top_tokens) != len(message.top_logprobs):
        raise WireError("a token's logprob needs one value per alternative")
    top = tuple(zip(message.top_tokens, message.top_logprobs, strict=True))
    return TokenLogprob(message.token, message.logprob, top)


def decode_params(message: common_pb2.SamplingParams) -> SamplingParams:
    """Stop strings and EOS handling stay with the gateway; the verifier only samples."""
    try:
        return SamplingParams(
            temperature=message.temperature,
            top_p=message.top_p or 1.0,
            max_tokens=message.max_tokens or 1,
            seed=message.seed if message.HasField("seed") else None,
            presence_penalty=message.presence_penalty,
            frequency_penalty=message.frequency_penalty,
            logit_bias=tuple(sorted(message.logit_bias.items())),
            top_k=message.top_k,
            logprobs=message.top_logprobs if message.HasField("top_logprobs") else None,
        )
    except ValueError as error:
        raise WireError(f"invalid sampling parameters: {error}") from None


# -- the gRPC edge: every request decoded and checked before any servicer work --------------
# Past these functions the servicers and the core only assert invariants; state the message
# alone cannot tell (an unknown sequence, a committed length that disagrees) is theirs.


def check_tokens(tokens, vocab_size: int, what: str = "token ids") -> list[int]:
    """``tokens`` as a list, each in [0, vocab_size)."""
    tokens = list(tokens)
    if any(not 0 <= t < vocab_size for t in tokens):
        raise WireError(f"{what} must be in [0, {vocab_size})")
    return tokens


def unique_ids(seq_ids: list[int], call: str) -> list[int]:
    if len(set(seq_ids)) != len(seq_ids):
        raise WireError(f"a sequence may appear once per {call} call")
    return seq_ids


def checked_params(message: common_pb2.SamplingParams, vocab_size: int) -> SamplingParams:
    params = decode_params(message)
    if any(not 0 <= token < vocab_size for token, _ in params.logit_bias):
        raise WireError(f"logit_bias token ids must be in [0, {vocab_size})")
    return params


@dataclass(frozen=True, slots=True, eq=False)
class PrefillJob:
    seq_id: int
    prompt: list[int]
    params: SamplingParams
    next_token: int | None  # resuming: the decided next token
    prompt_len: int
    return_hidden: bool


def decode_prefill(request, vocab_size: int, max_rows: int) -> list[PrefillJob]:
    """Non-empty prompts of known token ids whose prompt + max_tokens fit ``max_rows`` (the
    KV rows left beside one tree)."""
    jobs = []
    unique_ids([item.seq_id for item in request.items], "Prefill")
    for item in request.items:
        prompt = check_tokens(item.prompt_ids, vocab_size, f"sequence {item.seq_id}: prompt ids")
        resume = item.next_token if item.HasField("next_token") else None
        if not prompt:
            raise WireError(f"sequence {item.seq_id}: the prompt must hold at least one token")
        check_tokens([] if resume is None else [resume], vocab_size, "next_token")
        if item.prompt_len > len(prompt):
            raise WireError(f"sequence {item.seq_id}: prompt_len is past the prompt")
        params = checked_params(item.params, vocab_size)
        if len(prompt) + params.max_tokens > max_rows:
            raise WireError(
                f"sequence {item.seq_id}: prompt + max_tokens + tree needs more KV rows than "
                f"the verifier holds ({max_rows} beside one tree)"
            )
        jobs.append(
            PrefillJob(item.seq_id, prompt, params, resume, item.prompt_len, item.return_hidden)
        )
    return jobs


@dataclass(frozen=True, slots=True, eq=False)
class VerifyJob:
    seq_id: int
    num_committed: int
    tree: TokenTree
    steps: int  # >= 1
    free_drafts: bool
    return_hidden: bool


def decode_verify(request, vocab_size: int, max_nodes: int) -> list[VerifyJob]:
    """One job per item: distinct sequences, valid trees, 1..MAX_VERIFY_STEPS steps (several
    only for a root-only tree)."""
    unique_ids([item.ref.seq_id for item in request.items], "Verify")
    jobs = []
    for item in request.items:
        seq_id = item.ref.seq_id
        tree = decode_tree(item.tree, vocab_size, max_nodes)
        if item.steps > MAX_VERIFY_STEPS:
            raise WireError(f"sequence {seq_id}: more than {MAX_VERIFY_STEPS} steps")
        if item.steps > 1 and tree.num_nodes != 1:
            raise WireError(f"sequence {seq_id}: several steps need a root-only tree")
        steps = max(item.steps, 1)
        jobs.append(
            VerifyJob(
                seq_id, item.ref.num_committed, tree, steps, item.free_drafts, item.return_hidden
            )
        )
    return jobs


@dataclass(frozen=True, slots=True, eq=False)
class StartJob:
    seq_id: int
    prompt: list[int]
    first_token: int
    params: SamplingParams | None
    resync: bool
    message: object  # the StartItem (its hidden rows: the drafter's receiver decodes them)


def decode_start(request, vocab_size: int, needs_hidden: bool = False) -> list[StartJob]:
    """Distinct sequences, known tokens, a committed length that is the prompt's and (a
    drafter that reads hidden states: ``needs_hidden``) the prompt's hidden rows."""
    unique_ids([item.ref.seq_id for item in request.items], "Start")
    jobs = []
    for item in request.items:
        seq_id = item.ref.seq_id
        prompt = check_tokens(item.prompt_ids, vocab_size, f"sequence {seq_id}: prompt ids")
        if not prompt or item.ref.num_committed != len(prompt):
            raise WireError(f"sequence {seq_id}: num_committed must equal the prompt length")
        if needs_hidden and not item.HasField("prompt_hidden"):
            raise WireError(f"sequence {seq_id}: this drafter needs prompt_hidden")
        first = check_tokens([item.first_token], vocab_size, "first_token")[0]
        params = checked_params(item.params, vocab_size) if item.HasField("params") else None
        jobs.append(StartJob(seq_id, prompt, first, params, item.resync, item))
    return jobs


@dataclass(frozen=True, slots=True, eq=False)
class StepJob:
    seq_id: int
    num_committed: int
    next_token: int
    draft: bool
    unseen: list  # the item's VerifiedStep messages, checked (their hidden rows undecoded)
    message: object  # the StepItem


def decode_step(request, vocab_size: int, needs_hidden: bool = False) -> list[StepJob]:
    """Distinct sequences, known tokens, at most MAX_QUIET_STEPS unseen steps each holding the
    root and its accepted tokens (and their hidden rows, for a drafter that reads hidden
    states: ``needs_hidden``), and a caller hop in [0, MAX_HOP_SECONDS]."""
    if not 0 <= request.caller_hop_seconds <= MAX_HOP_SECONDS:  # (NaN fails too)
        raise WireError(f"caller_hop_seconds must be in [0, {MAX_HOP_SECONDS}]")
    unique_ids([item.ref.seq_id for item in request.items], "Step")
    jobs = []
    for item in request.items:
        seq_id = item.ref.seq_id
        root = check_tokens([item.next_token], vocab_size, f"sequence {seq_id}: next_token")[0]
        if len(item.unseen) > MAX_QUIET_STEPS:
            raise WireError(f"sequence {seq_id}: more than {MAX_QUIET_STEPS} unseen steps")
        for step in item.unseen:
            if not step.committed or step.num_accepted != len(step.committed) - 1:
                raise WireError(
                    f"sequence {seq_id}: committed must hold the root + accepted tokens"
                )
            check_tokens([*step.committed, step.next_token], vocab_size, "unseen token ids")
            if needs_hidden and item.draft and not step.HasField("hidden"):
                raise WireError(f"sequence {seq_id}: this drafter needs unseen steps' hidden")
        jobs.append(
            StepJob(seq_id, item.ref.num_committed, root, item.draft, list(item.unseen), item)
        )
    return jobs


def verified_step(seq_id: int, result: verifier_pb2.VerifyResult, hidden) -> VerifiedStep:
    """What a verifier's result taught about one sequence, with its hidden rows if any."""
    return VerifiedStep(
        seq_id=seq_id,
        committed=list(result.committed),
        hidden=hidden,
        next_token=result.tokens[-1],
        num_accepted=result.num_accepted,
        num_committed=result.ref.num_committed,
    )


def encode_prefilled(seq_id: int, prefilled) -> verifier_pb2.PrefillResult:
    """A prefill's result (``lyanna.target.Prefilled``), without its hidden rows."""
    first = prefilled.logprobs
    return verifier_pb2.PrefillResult(
        ref=common_pb2.SeqRef(seq_id=seq_id, num_committed=prefilled.num_committed),
        first_token=prefilled.first_token,
        first_logprob=encode_logprob(first[0]) if first else None,
    )


def encode_verify_result(seq_id: int, runs) -> verifier_pb2.VerifyResult:
    """One item's result from its verifications ``runs`` (``(tree, lyanna.target.Verified)``
    pairs, in order: one, or several decode steps), without hidden rows."""
    (first_tree, first), (_, last) = runs[0], runs[-1]
    result = verifier_pb2.VerifyResult(
        ref=common_pb2.SeqRef(seq_id=seq_id, num_committed=last.num_committed),
        committed=[token for _, v in runs for token in v.committed],
        tokens=[token for _, v in runs for token in v.verdict.tokens],
        num_accepted=first.verdict.num_accepted,
        num_drafted_per_depth=first.verdict.num_drafted_per_depth,
        num_drafted=first_tree.num_drafted,
        num_steps=len(runs),
    )
    if all(v.logprobs is not None for _, v in runs):  # one per token, when asked
        result.logprobs.extend(encode_logprob(e) for _, v in runs for e in v.logprobs)
    if len(runs) > 1 and any(tree.num_drafted for tree, _ in runs):  # free drafts
        result.step_accepted.extend(v.verdict.num_accepted for _, v in runs)
        result.step_drafted.extend(tree.num_drafted for tree, _ in runs)
    return result
