"""Wire codecs between core objects and ``services.pb`` messages, with strict validation.

Tensors travel as raw little-endian bytes plus dtype and shape, never pickled: decoding checks
the dtype against a whitelist, the rank and element count against bounds and the byte length
against the shape before a single byte becomes a tensor. Token trees travel as tokens and
parent pointers (``TokenTree.__post_init__`` re-checks the structure); every malformed message
raises ``WireError`` (a ``ValueError``), which the servicers map to INVALID_ARGUMENT.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

import lyanna.drafters
from lyanna.sampling import SamplingParams, TokenLogprob
from lyanna.tree import DraftScheme, TokenTree
from services.pb import common_pb2

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
