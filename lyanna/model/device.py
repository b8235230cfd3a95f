"""Where and in what a model runs: the ``--device`` and ``--dtype`` settings of ``lyanna serve``
and ``generate``, the benchmarks (``add_placement_args``) and the verifier and drafter
services, parsed and checked at start-up so a wrong value is one clear error before any model
loads (not a crash deep inside the first forward).

CPU in float32 is the default and what CI runs; on a GPU, bf16 is the usual choice. The 4-bit
weight formats run on the CPU in float32 only (``check_placement``; ``weights=auto`` picks the
dense weights anywhere else, see ``lyanna.model.load_model``).
"""

from __future__ import annotations

import argparse
import os

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
DEVICE_TYPES = ("cpu", "cuda")
CPU_ONLY_WEIGHTS = ("q4", "q4a8")


def parse_dtype(name: str) -> torch.dtype:
    """``float32`` / ``bfloat16`` (``bf16``) / ``float16`` (``fp16``) as a torch dtype."""
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {name!r}") from None


def parse_device(name: str, usable_here: bool = True) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N`` as a torch device; with ``usable_here``, a CUDA device
    must be usable in this process (a gateway that only relays to remote services need not
    have the GPU its services run on)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {name!r}: use cpu, cuda or cuda:N") from None
    if device.type not in DEVICE_TYPES:
        raise ValueError(f"device must be cpu, cuda or cuda:N; got {name!r}")
    if device.type == "cuda" and usable_here:
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {name!r} needs CUDA, but torch.cuda.is_available() is False here (a "
                "CPU-only torch build, or no visible GPU); use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
    return device


def check_placement(weights: str, dtype: torch.dtype, device: torch.device | str) -> None:
    """Refuse a 4-bit weight format off the CPU or outside float32 (it has no kernel there)."""
    if weights in CPU_ONLY_WEIGHTS and (
        torch.device(device).type != "cpu" or dtype != torch.float32
    ):
        raise ValueError(
            f"weights={weights!r} runs on the CPU in float32 only (got {torch.device(device)}, "
            f"{dtype}); use --weights auto or fp32 there"
        )


def parse_placement(
    device: str, dtype: str, weights: str = "auto"
) -> tuple[torch.device, torch.dtype]:
    """Both settings parsed and checked together with the weight format."""
    torch_device, torch_dtype = parse_device(device), parse_dtype(dtype)
    check_placement(weights, torch_dtype, torch_device)
    return torch_device, torch_dtype


def add_placement_args(parser: argparse.ArgumentParser, services: bool = False) -> None:
    """``--device`` / ``--dtype``, defaults from ``LYANNA_DEVICE`` / ``LYANNA_DTYPE``; a
    malformed value is a usage error (``placement`` checks the rest)."""

    def checked(parse):
        def convert(text: str) -> str:
            try:
                parse(text)
            except ValueError as err:
                raise argparse.ArgumentTypeError(str(err)) from None
            return text

        return convert

    where = "the target (embedded) or both services (services mode)" if services else "the model"
    parser.add_argument(
        "--device",
        type=checked(lambda name: parse_device(name, usable_here=False)),
        default=os.environ.get("LYANNA_DEVICE", "cpu"),
        help=f"where {where} runs: cpu, cuda or cuda:N; off the CPU every method but sps "
        "drafts there (env LYANNA_DEVICE)",
    )
    parser.add_argument(
        "--dtype",
        type=checked(parse_dtype),
        default=os.environ.get("LYANNA_DTYPE", "float32"),
        help=f"the weights' and KV cache's dtype: {', '.join(DTYPES)}; bf16 on a GPU; the 4-bit "
        "--weights need float32 on the CPU (auto picks dense elsewhere) (env LYANNA_DTYPE)",
    )


def placement(args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """``(device, dtype)`` of parsed ``add_placement_args`` flags and ``--weights``;
    ``ValueError`` unless CUDA is usable here and the weights run there."""
    return parse_placement(args.device, args.dtype, args.weights)
