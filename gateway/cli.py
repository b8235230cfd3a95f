"""The ``lyanna`` command line: fetch the default model, answer one chat prompt, serve the
OpenAI-compatible API (``serve``) and chat with it from a terminal (``chat``)."""

from __future__ import annotations

import argparse
import os
import sys

from lyanna.model.device import add_placement_args, placement
from lyanna.sampling import SamplingParams


def _cmd_fetch_model(args: argparse.Namespace) -> int:
    from lyanna.model.default import fetch_default_model
    from lyanna.model.native import load_decoder

    print(fetch_default_model())
    # build the native decoder now rather than inside a service's start-up (about 50 s once)
    ready = load_decoder() is not None
    print("native decoder:", "ready" if ready else "unavailable (eager layers)")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from lyanna.decode import generate
    from lyanna.sequence import Sequence
    from lyanna.serving_model import load
    from lyanna.tokenizer import chat_prompt_ids, make_detokenize

    device, dtype = placement(args)
    loaded = load(args.model, args.weights, device, dtype)
    model, tokenizer = loaded.model, loaded.tokenizer
    params = SamplingParams(
        args.temperature, args.top_p, args.max_tokens, seed=args.seed, stop=tuple(args.stop)
    )
    prompt_ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": args.prompt}])
    # the gateway's decoding, so that stop strings match as they would there
    sequence = Sequence(0, prompt_ids, params, loaded.eos_token_ids, make_detokenize(tokenizer))
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


def _cmd_serve(args: argparse.Namespace) -> int:
    from gateway.launcher import run_serve

    return run_serve(args)


def _cmd_chat(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from client.chat import ChatOptions, run_chat

    options = ChatOptions(**{f.name: getattr(args, f.name) for f in fields(ChatOptions)})
    return run_chat(options, args.prompt)


def _env(parser: argparse.ArgumentParser, flag: str, kind: type, default, help: str, **kw) -> None:
    """A flag whose default comes from ``LYANNA_<FLAG>`` when set."""
    env = "LYANNA_" + flag.lstrip("-").replace("-", "_").upper()
    value = os.environ.get(env)
    default = default if value is None else kind(value)
    parser.add_argument(flag, type=kind, default=default, help=f"{help} (env {env})", **kw)


def _add_weights(parser: argparse.ArgumentParser) -> None:
    from lyanna.model.loader import WEIGHT_FORMATS

    _env(
        parser,
        "--weights",
        str,
        "auto",
        "target weights: q4 = the GGUF's 4-bit blocks on the int4 kernel, q4a8 = the same with "
        "int8 activations (llama.cpp's numerics: faster, less exact), fp32 = dequantized "
        "(exact), auto = fp32 or q4, whichever measured faster here",
        choices=WEIGHT_FORMATS,
    )


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    serve.add_argument("--mode", choices=("embedded", "services"), default="embedded")
    serve.add_argument("--host", help="default 127.0.0.1 (env LYANNA_HOST)")
    serve.add_argument("--port", type=int, help="default 8000 (env LYANNA_PORT)")
    serve.add_argument("--method", default="lyanna", help="default speculative method")
    serve.add_argument("--model", help="an HF directory or .gguf (default: SmolLM2-135M)")
    _add_weights(serve)
    add_placement_args(serve, services=True)
    cost = "cost: each step drafts only the nodes that pay for their verification (the target's"
    fixed = "cost curve, measured once per machine); fixed: every method's full default budget"
    _env(serve, "--tree", str, "cost", f"{cost} {fixed}", choices=("cost", "fixed"))
    threads = "compute threads of the target (embedded) or the verifier (services); 0 = every CPU"
    _env(serve, "--threads", int, 0, f"{threads} (services: the drafter takes one beside it)")
    serve.add_argument("--max-running", type=int, default=8, help="running sequences per engine")
    serve.add_argument("--max-len", type=int, default=2048, help="KV rows per sequence")
    serve.add_argument("--max-waiting", type=int, default=64, help="queue bound (then 429)")
    remote = "services mode:"
    for flag, kind, default, help in (  # None: unset (per-key limits: GatewayConfig's)
        ("--api-keys-file", str, None, "API keys, one per line, reloaded when the file changes"),
        ("--max-streams-per-key", int, None, "requests in flight per API key, then 429; 0: none"),
        ("--max-tokens-per-minute-per-key", int, None, "tokens per API key per minute, then 429"),
        ("--queue-timeout", float, 60.0, "seconds a request may wait for a slot (then 429)"),
        ("--verifier-addr", str, None, f"{remote} use this running verifier (host:port)"),
        ("--drafter-addr", str, None, f"{remote} the running drafter beside --verifier-addr"),
        ("--draft-deadline", float, 2.0, f"{remote} seconds to draft a step (then target-only)"),
        ("--verify-deadline", float, 60.0, f"{remote} seconds a Verify may take (then resume)"),
        ("--control-deadline", float, 10.0, f"{remote} seconds a Start, Release, Info may take"),
        ("--max-steps-per-call", int, 8, f"{remote} plain decode steps per Verify when no draft"),
        ("--drain-seconds", float, 60.0, "on SIGTERM: how long streams in flight may finish"),
    ):
        _env(serve, flag, kind, default, help)
    serve.add_argument(
        "--pipeline",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"{remote} asynchronous two-lane pipeline; by default on where drafter and "
        "verifier do not share the CPU's cores (--verifier-addr, or a GPU device)",
    )
    _env(
        serve,
        "--data-plane",
        str,
        "grpc",
        f"{remote} how hidden states travel from the verifier to the drafter: grpc (inline), "
        "gloo (torch.distributed, CPU) or nccl (GPU); the services must run with the same",
        choices=("grpc", "gloo", "nccl"),
    )
    serve.add_argument("--log-level", default="info")
    serve.set_defaults(func=_cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lyanna", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch-model", help="fetch the default model, build the native decoder")
    fetch.set_defaults(func=_cmd_fetch_model)
    gen = sub.add_parser("generate", help="answer one chat prompt with plain decoding")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--model", help="a .gguf file or HF directory (default: SmolLM2-135M)")
    _add_weights(gen)
    add_placement_args(gen)
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.set_defaults(func=_cmd_generate)
    _add_serve(sub)
    chat = sub.add_parser("chat", help="chat with a running server (streams, shows tokens/s)")
    chat.add_argument("--url", default="http://127.0.0.1:8000/v1")
    chat.add_argument("--api-key", default="none")
    chat.add_argument("--model", help="default: the first model the server lists")
    chat.add_argument("--method", help="speculative method for these requests")
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--prompt", help="ask once and exit (default: interactive)")
    chat.set_defaults(func=_cmd_chat)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, RuntimeError) as err:
        print(f"lyanna: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
