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

from gateway.chat import ChatOptions, run_chat
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
    from gateway.chat import ChatSession

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
