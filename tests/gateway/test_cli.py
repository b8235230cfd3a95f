"""``lyanna serve`` and ``lyanna chat`` as real processes: the server prints its URL and an
example curl, answers the terminal client (which shows tokens/s and acceptance length), and
shuts down cleanly on SIGINT. In services mode it also starts (and stops) the verifier and
drafter gRPC services, three processes in all."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

from client.chat import ChatOptions, run_chat
from gateway.server import free_port


def read_banner(process: subprocess.Popen, timeout: float = 120.0) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip())
        if "Metrics:" in line:
            return lines
    process.kill()
    raise AssertionError(f"no banner; got {lines}")


@pytest.mark.parametrize("mode", ["embedded", pytest.param("services", marks=pytest.mark.slow)])
def test_serve_and_chat_processes(tiny_chat_dir, mode) -> None:
    port = free_port()
    command = [sys.executable, "-m", "gateway.cli", "serve", "--model", str(tiny_chat_dir)]
    command += ["--port", str(port), "--method", "ngram", "--max-len", "512", "--mode", mode]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        banner = "\n".join(read_banner(server))
        url = f"http://127.0.0.1:{port}"
        assert f"{url}/v1" in banner and "curl" in banner and "lyanna chat" in banner
        assert f"({mode} mode, default method ngram)" in banner
        chat = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "chat", "--url", f"{url}/v1"]
            + ["--prompt", "Say something.", "--max-tokens", "16"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert chat.returncode == 0, chat.stderr
        assert chat.stdout.strip()
        assert "16 tokens" in chat.stderr and "acceptance length" in chat.stderr
        assert "(ngram)" in chat.stderr
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 0


def test_chat_reports_an_unreachable_server(capsys) -> None:
    options = ChatOptions(url=f"http://127.0.0.1:{free_port()}/v1")
    assert run_chat(options, "hi") == 1
    assert "lyanna chat:" in capsys.readouterr().err


def test_chat_session_keeps_the_conversation(gateway, capsys) -> None:
    from client.chat import ChatSession

    session = ChatSession(ChatOptions(url=gateway.url + "/v1", max_tokens=6, system="Be brief."))
    first = session.ask("Hello!")
    second = session.ask("And again?")
    assert [m["role"] for m in session.messages] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    assert first.completion_tokens == second.completion_tokens == 6
    assert first.acceptance_length is not None and first.method == "ngram"
    assert "tokens/s" in first.line() and "acceptance length" in first.line()
    assert capsys.readouterr().out.count("\n") == 2


def test_serve_integer_flags_take_their_defaults_from_the_environment(monkeypatch) -> None:
    from gateway.cli import build_parser

    assert build_parser().parse_args(["serve"]).max_steps_per_call == 8
    monkeypatch.setenv("LYANNA_MAX_STEPS_PER_CALL", "3")
    monkeypatch.setenv("LYANNA_THREADS", "2")
    args = build_parser().parse_args(["serve"])
    assert (args.max_steps_per_call, args.threads) == (3, 2)
    assert build_parser().parse_args(["serve", "--threads", "1"]).threads == 1  # flag wins


def test_serve_device_and_dtype_take_their_defaults_from_the_environment(monkeypatch) -> None:
    from gateway.cli import build_parser, placement

    args = build_parser().parse_args(["serve"])
    assert (args.device, args.dtype) == ("cpu", "float32")
    monkeypatch.setenv("LYANNA_DEVICE", "cpu")
    monkeypatch.setenv("LYANNA_DTYPE", "bf16")
    cpu = torch.device("cpu")
    assert placement(build_parser().parse_args(["serve"])) == (cpu, torch.bfloat16)
    args = build_parser().parse_args(["serve", "--dtype", "fp16"])  # the flag wins
    assert placement(args) == (cpu, torch.float16)
    assert build_parser().parse_args(["generate", "--prompt", "p"]).dtype == "bf16"


@pytest.mark.parametrize(
    "argv, env",
    [
        (["serve", "--dtype", "int8"], {}),
        (["serve", "--device", "tpu"], {}),
        (["serve"], {"LYANNA_DTYPE": "double"}),  # a bad environment value is refused too
    ],
)
def test_serve_refuses_unknown_devices_and_dtypes(monkeypatch, capsys, argv, env) -> None:
    from gateway.cli import build_parser

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    error = capsys.readouterr().err
    assert "error: argument --d" in error and ("dtype must be" in error or "device" in error)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("mode", ["embedded", "services"])
def test_serve_on_cuda_without_cuda_fails_before_loading(capsys, mode) -> None:
    from gateway.cli import main

    argv = ["serve", "--mode", mode, "--model", "/nonexistent", "--device", "cuda"]
    assert main([*argv, "--port", str(free_port())]) == 2
    assert "needs CUDA" in capsys.readouterr().err


def test_serve_refuses_4bit_weights_in_bf16_before_loading(capsys) -> None:
    from gateway.cli import main

    argv = ["serve", "--model", "/nonexistent", "--weights", "q4", "--dtype", "bf16"]
    assert main([*argv, "--port", str(free_port())]) == 2
    assert "runs on the CPU in float32 only" in capsys.readouterr().err


def test_services_mode_passes_device_and_dtype_to_both_services(tiny_chat_dir, monkeypatch) -> None:
    import services.launch
    from gateway.cli import build_parser
    from gateway.config import GatewayConfig
    from gateway.launcher import _serve_services

    calls = []

    def no_launch(model, method, verifier_args, drafter_args, plane="grpc"):
        assert plane == "grpc"  # the default data plane: hidden states inline
        calls.append((method, verifier_args, drafter_args))
        raise services.launch.LaunchError("not in this test")

    monkeypatch.setattr(services.launch, "launch", no_launch)
    argv = ["serve", "--mode", "services", "--model", str(tiny_chat_dir), "--dtype", "bf16"]
    with pytest.raises(RuntimeError, match="no method"):
        _serve_services(build_parser().parse_args(argv), GatewayConfig(mode="services"))
    for _, verifier_args, drafter_args in calls:
        for service_args in (verifier_args, drafter_args):
            flags = dict(zip(service_args[::2], service_args[1::2], strict=True))
            assert (flags["--device"], flags["--dtype"]) == ("cpu", "bf16")
    assert calls and calls[0][0] == "lyanna"  # then each fallback method, all refused here


def test_generate_answers_one_prompt(tiny_chat_dir, capsys) -> None:
    from gateway.cli import main

    argv = ["generate", "--prompt", "Hi", "--model", str(tiny_chat_dir), "--max-tokens", "4"]
    assert main(argv) == 0
    assert "tokens/s, finish:" in capsys.readouterr().err
