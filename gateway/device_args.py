"""``--device`` / ``--dtype`` for every command that loads a model (``lyanna generate`` and
``serve``, the benchmarks), checked before anything loads; its own module so that
``gateway.cli`` and ``gateway.launcher`` share it without importing each other."""

from __future__ import annotations

import argparse
import os


def add_placement_args(parser: argparse.ArgumentParser, services: bool = False) -> None:
    """Defaults from ``LYANNA_DEVICE`` / ``LYANNA_DTYPE``; a malformed value is a usage error
    (``placement`` checks the rest)."""
    from lyanna.model.device import DTYPES, parse_device, parse_dtype

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


def placement(args: argparse.Namespace):
    """``(device, dtype)``; ``ValueError`` unless CUDA is usable here and the weights run there."""
    from lyanna.model.device import parse_placement

    return parse_placement(args.device, args.dtype, args.weights)
