"""The ``lyanna`` command line: fetch the default model, answer a chat prompt."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lyanna.sampling import SamplingParams


def _cmd_fetch_model(args: argparse.Namespace) -> int:
    from lyanna.model.default import fetch_default_model

    print(fetch_default_model())
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from lyanna.decode import generate
    from lyanna.model import fetch_default_model, load_model
    from lyanna.sequence import Sequence
    from lyanna.tokenizer import chat_prompt_ids, load_tokenizer

    model_path = Path(args.model) if args.model else fetch_default_model()
    model = load_model(model_path)
    tokenizer = load_tokenizer(model_path)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    messages = [{"role": "user", "content": args.prompt}]
    sequence = Sequence(
        seq_id=0,
        prompt_ids=chat_prompt_ids(tokenizer, messages),
        params=params,
        eos_token_ids=frozenset({tokenizer.eos_token_id, model.config.eos_token_id} - {None}),
        detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )
    stats = generate(model, [sequence])
    print(sequence.output_text())
    rate = stats.num_output_tokens / max(stats.decode_seconds, 1e-9)
    print(
        f"[{stats.num_output_tokens} tokens, prompt {stats.num_prompt_tokens} tokens in "
        f"{stats.prefill_seconds:.2f} s, decode {rate:.1f} tokens/s, "
        f"finish: {sequence.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lyanna", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch-model", help="fetch and convert the default model once")
    fetch.set_defaults(func=_cmd_fetch_model)
    gen = sub.add_parser("generate", help="answer one chat prompt with plain decoding")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--model", help="a .gguf file or HF directory (default: SmolLM2-135M)")
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.set_defaults(func=_cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"lyanna: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
