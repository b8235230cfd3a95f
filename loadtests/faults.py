"""Scripted fault runs over HTTP against the real three-process deployment: the verifier and
drafter services (``services.launch``) and a ``lyanna serve --mode services`` gateway process
in front of them. Each run sends a few greedy streaming chat requests through the gateway's
HTTP API, injects one fault at a random point, and compares every answer with plain greedy
decoding on the same weights: the text and the usage's token count (a lost, duplicated or
changed token shows as a mismatch). After each run the verifier's KV slot gauge
(``lyanna_verifier_kv_slots{state="used"}``, its /metrics) must come back to 0: for
``gateway-kill`` within the slot lease (``--lease-seconds``), since a killed gateway never
releases. Results feed ``docs/reliability.md``.

    python -m loadtests.faults [--runs 20] [--faults gateway-kill,...] [--max-tokens 48]

Faults: ``drafter-kill`` (SIGKILL the drafter mid-generation, restart it after the run),
``drafter-restart`` (stale state: SIGKILL the drafter and start a new one on its port at once),
``verifier-restart`` (SIGKILL the verifier and start it again on its port), ``verifier-pause``
(SIGSTOP the verifier for 4 s behind a gateway with 2 s call deadlines: a stalled node),
``drafter-late`` (a gateway whose drafts all miss a 1 ms deadline: target-only steps),
``client-disconnect`` (one client closes its stream mid-answer), and ``gateway-kill``
(SIGKILL the gateway mid-stream: its clients are cut, the answer so far must be a prefix of
the greedy one, and the verifier must reclaim every slot it held once the lease runs out;
a new gateway serves the next run). Loopback only; every run is bounded in tokens and time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

FAULTS = (
    "drafter-kill",
    "drafter-restart",
    "verifier-restart",
    "verifier-pause",
    "drafter-late",
    "client-disconnect",
    "gateway-kill",
)
RUN_SECONDS = 300.0
PAUSE_SECONDS = 4.0  # verifier-pause: the stall (the gateway's deadlines are half of it)
USED_SLOTS = re.compile(r'^lyanna_verifier_kv_slots\{state="used"\} (\S+)$', re.MULTILINE)
# each fault's gateway flags (the others run the default gateway)
GATEWAY_FLAGS = {
    "drafter-late": ("--draft-deadline", "0.001"),
    "verifier-pause": (
        "--verify-deadline",
        str(PAUSE_SECONDS / 2),
        "--control-deadline",
        str(PAUSE_SECONDS / 2),
    ),
}


@dataclass(slots=True)
class Tally:
    """What one fault class's runs saw."""

    runs: int = 0
    requests: int = 0
    exact: int = 0  # complete answers equal to plain greedy (text and token count)
    cut_prefix: int = 0  # cut streams (client gone, gateway killed) whose text is a prefix
    mismatched: int = 0  # lost, duplicated or changed tokens
    client_errors: int = 0  # requests that ended in an error the client saw (unexpected)
    cut_by_kill: int = 0  # streams cut by the gateway's death (expected for gateway-kill)
    slots_leaked: int = 0  # verifier slots still held after the run (after the lease)
    held_at_kill: int = 0  # gateway-kill: slots the dead gateway held (the lease frees them)
    reclaim_seconds: list[float] = field(default_factory=list)  # kill -> gauge at 0
    seconds: float = 0.0
    harness_error: str | None = None  # the run could not go on (not a fault's outcome)


@dataclass(slots=True)
class Answer:
    text: str = ""
    chunks: int = 0
    completion_tokens: int | None = None
    done: bool = False
    error: str | None = None


class Progress:
    """Chunks received by every client of a run (the fault fires after ``at`` of them)."""

    def __init__(self) -> None:
        self.chunks = 0
        self.changed = asyncio.Event()

    def add(self) -> None:
        self.chunks += 1
        self.changed.set()


class GatewayProcess:
    """``lyanna serve --mode services`` in front of running services, as its own process."""

    def __init__(self, deployment, model: Path, method: str, log_dir: Path) -> None:
        self.deployment, self.model, self.method, self.log_dir = deployment, model, method, log_dir
        self.process: subprocess.Popen | None = None
        self.port = 0
        self.flags: tuple[str, ...] = ()
        self.model_name = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, flags: tuple[str, ...] = (), timeout: float = 300.0) -> None:
        from services.launch import free_port

        self.port, self.flags = free_port(), flags
        argv = [sys.executable, "-m", "gateway.cli", "serve", "--mode", "services"]
        argv += ["--verifier-addr", self.deployment.verifier_addr]
        argv += ["--drafter-addr", self.deployment.drafter_addr, "--model", str(self.model)]
        argv += ["--method", self.method, "--port", str(self.port), "--queue-timeout", "120"]
        argv += ["--drain-seconds", "10", "--log-level", "warning", *flags]
        log = (self.log_dir / "gateway.log").open("ab")
        self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the gateway exited; see {self.log_dir / 'gateway.log'}")
            try:
                if httpx.get(self.url + "/readyz", timeout=5).status_code == 200:
                    models = httpx.get(self.url + "/v1/models", timeout=5).json()
                    self.model_name = models["data"][0]["id"]
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not become ready")
            time.sleep(0.3)

    def kill(self) -> None:
        """SIGKILL: no drain, no Release (an OOM kill looks the same to the services)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self, flags: tuple[str, ...] | None = None) -> None:
        self.stop()
        self.start(self.flags if flags is None else flags)


def used_slots(log_dir: Path) -> int:
    """The verifier's ``lyanna_verifier_kv_slots{state="used"}`` (its metrics port file is
    rewritten by each verifier process: read it every time)."""
    port = int((log_dir / "verifier.metrics-port").read_text())
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return int(float(USED_SLOTS.search(text).group(1)))


async def wait_for_free_slots(log_dir: Path, within: float) -> tuple[int, float]:
    """Poll the slot gauge until no slot is used or ``within`` seconds pass: (used, seconds)."""
    start = time.monotonic()
    while True:
        try:
            used = await asyncio.to_thread(used_slots, log_dir)
        except (httpx.HTTPError, OSError, ValueError):  # a verifier starting again
            used = -1
        elapsed = time.monotonic() - start
        if used == 0 or elapsed > within:
            return max(used, 0), elapsed
        await asyncio.sleep(0.2)


async def stream_chat(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    progress: Progress,
    stop_after: int | None = None,
) -> Answer:
    """One greedy streaming chat request; ``stop_after`` chunks, then the client leaves."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    answer = Answer()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                answer.error = f"HTTP {response.status_code}"
                return answer
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    answer.done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    answer.error = str(chunk["error"].get("code") or "stream error")
                    break
                if chunk.get("usage"):
                    answer.completion_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or []:
                    answer.text += choice["delta"].get("content") or ""
                    answer.chunks += 1
                    progress.add()
                if stop_after is not None and answer.chunks >= stop_after:
                    return answer  # the client walks away: the stream closes
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        answer.error = type(error).__name__
    return answer


def pause(pid: int, seconds: float) -> None:
    """A stalled verifier (SIGSTOP, then SIGCONT): calls in flight pass their deadline while
    it still holds, and may still change, their sequences."""
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


async def one_run(
    deployment,
    gateway: GatewayProcess,
    fault: str,
    prompts: list[str],
    expected: list[tuple[str, int]],
    max_tokens: int,
    lease_seconds: float,
    rng: random.Random,
    tally: Tally,
) -> None:
    progress = Progress()
    at = rng.randint(2, 3 * max_tokens // 4)  # chunks received before the fault
    stop_after = rng.randint(1, max_tokens - 1) if fault == "client-disconnect" else None
    actions = {
        "drafter-kill": lambda: deployment.kill("drafter"),
        "drafter-restart": lambda: deployment.restart("drafter"),
        "verifier-restart": lambda: deployment.restart("verifier"),
        "verifier-pause": lambda: pause(deployment.pid("verifier"), PAUSE_SECONDS),
        "gateway-kill": gateway.kill,
    }
    done = asyncio.Event()
    fired: list[int] = []

    async def inject() -> None:
        if fault not in actions:
            return
        while progress.chunks < at and not done.is_set():
            progress.changed.clear()
            with_timeout = asyncio.wait_for(progress.changed.wait(), timeout=0.5)
            await asyncio.gather(with_timeout, return_exceptions=True)
        if done.is_set() and fault == "gateway-kill":
            return  # the answers were shorter than ``at``: nothing to kill mid-stream
        await asyncio.to_thread(actions[fault])
        fired.append(1)

    async def requests() -> list[Answer]:
        timeout = httpx.Timeout(RUN_SECONDS, connect=10)
        async with httpx.AsyncClient(timeout=timeout) as client:
            jobs = [
                stream_chat(
                    client,
                    gateway.url,
                    gateway.model_name,
                    prompt,
                    max_tokens,
                    progress,
                    stop_after if i == 0 else None,
                )
                for i, prompt in enumerate(prompts)
            ]
            answers = await asyncio.gather(*jobs)
        done.set()
        return list(answers)

    answers, _ = await asyncio.wait_for(asyncio.gather(requests(), inject()), RUN_SECONDS)
    killed = fault == "gateway-kill" and bool(fired)
    if killed:
        tally.held_at_kill += await asyncio.to_thread(used_slots, deployment.log_dir)
        # nobody will release them: the lease must (its reaper checks every <= 1 s)
        leaked, seconds = await wait_for_free_slots(deployment.log_dir, lease_seconds + 15)
        tally.reclaim_seconds.append(round(seconds, 1))
    else:
        leaked, _ = await wait_for_free_slots(deployment.log_dir, 10)  # releases in flight
    tally.runs += 1
    tally.slots_leaked += leaked
    for i, (answer, (text, count)) in enumerate(zip(answers, expected, strict=True)):
        tally.requests += 1
        cut = (fault == "client-disconnect" and i == 0) or (killed and not answer.done)
        if cut:
            ok = text.startswith(answer.text)
            tally.cut_prefix += ok
            tally.cut_by_kill += killed and answer.error is not None
        else:
            ok = answer.done and answer.text == text and answer.completion_tokens == count
            tally.exact += ok
            tally.client_errors += answer.error is not None
        tally.mismatched += not ok
    if fault == "drafter-kill":
        await asyncio.to_thread(deployment.restart, "drafter")
    if killed:
        await asyncio.to_thread(gateway.start, gateway.flags)


def greedy_references(
    model_dir: Path, prompts: list[str], max_tokens: int
) -> list[tuple[str, int]]:
    """Each prompt's plain greedy answer on the weights the verifier loads (one thread, its
    numerics), stopped at EOS like the gateway: (text as the gateway decodes it, tokens)."""
    import torch

    from lyanna.decode import generate
    from lyanna.sampling import SamplingParams
    from lyanna.sequence import Sequence
    from lyanna.serving_model import load
    from lyanna.tokenizer import chat_prompt_ids, make_detokenize

    torch.set_num_threads(1)
    loaded = load(model_dir, weights="auto")
    model, tokenizer, eos = loaded.model, loaded.tokenizer, loaded.eos_token_ids
    ids = [chat_prompt_ids(tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    seqs = [Sequence(i, p, SamplingParams(max_tokens=max_tokens), eos) for i, p in enumerate(ids)]
    generate(model, seqs)
    detokenize = make_detokenize(tokenizer)
    return [(detokenize(s.output_ids), len(s.output_ids)) for s in seqs]


def run_faults(
    model_dir: Path,
    faults: list[str],
    runs: int,
    method: str = "lyanna",
    max_tokens: int = 48,
    requests: int = 3,
    lease_seconds: float = 5.0,
    seed: int = 0,
    prompts: list[str] | None = None,
    service_args: tuple[str, ...] = (),
    log_dir: Path | None = None,
    startup_timeout: float = 900.0,
    keep_going: bool = False,
) -> dict[str, Tally]:
    """Every fault of ``faults``, ``runs`` times, against one deployment (a new gateway per
    fault class, and after each ``gateway-kill``); the tallies by fault. ``keep_going``: a
    fault class whose harness fails (a process that does not come back in time) is reported
    with the runs it finished and the next class runs."""
    from loadtests.load import load_prompts
    from services.launch import launch

    texts = (prompts or load_prompts())[:requests]
    expected = greedy_references(model_dir, texts, max_tokens)
    rng = random.Random(seed)
    scratch = None
    if log_dir is None:
        scratch = tempfile.TemporaryDirectory(prefix="lyanna-faults-")
        log_dir = Path(scratch.name)
    verifier_args = ("--lease-seconds", str(lease_seconds), "--metrics-port", "0")
    verifier_args += ("--metrics-port-file", str(log_dir / "verifier.metrics-port"))
    tallies: dict[str, Tally] = {}
    try:
        with launch(
            model_dir,
            method,
            verifier_args=(*verifier_args, *service_args),
            # the drafter's state is leased too (a killed gateway's would fill its slots);
            # longer, since quiet steps do not renew it
            drafter_args=("--lease-seconds", str(4 * lease_seconds), *service_args),
            log_dir=log_dir,
            startup_timeout=startup_timeout,
        ) as deployment:
            gateway = GatewayProcess(deployment, model_dir, method, log_dir)
            try:
                for fault in faults:
                    gateway.restart(GATEWAY_FLAGS.get(fault, ()))
                    tally, start = Tally(), time.perf_counter()
                    try:
                        for _ in range(runs):
                            asyncio.run(
                                one_run(
                                    deployment,
                                    gateway,
                                    fault,
                                    texts,
                                    expected,
                                    max_tokens,
                                    lease_seconds,
                                    rng,
                                    tally,
                                )
                            )
                    except Exception as error:
                        if not keep_going:
                            raise
                        tally.harness_error = f"{type(error).__name__}: {error}"[:300]
                        print(f"  {fault}: harness failed: {tally.harness_error}", flush=True)
                        for name in ("verifier", "drafter"):  # whatever it left down
                            if deployment.children[name].process.poll() is not None:
                                deployment.restart(name)
                    tally.seconds = round(time.perf_counter() - start, 1)
                    tallies[fault] = tally
                    print(f"  {fault}: {tally}", flush=True)
            finally:
                gateway.stop()
    finally:
        if scratch is not None:
            scratch.cleanup()
    return tallies


def table(tallies: dict[str, Tally]) -> str:
    rows = [
        "| fault | runs | requests | exact | cut, prefix intact | mismatched | client errors "
        "| slots leaked | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fault, t in tallies.items():
        name = fault if t.harness_error is None else f"{fault} (stopped: {t.harness_error})"
        rows.append(
            f"| {name} | {t.runs} | {t.requests} | {t.exact} | {t.cut_prefix} | {t.mismatched} "
            f"| {t.client_errors} | {t.slots_leaked} | {t.seconds:.0f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", "--reps", dest="runs", type=int, default=20)
    parser.add_argument("--method", default="lyanna")
    parser.add_argument("--model", help="HF directory or .gguf (default: SmolLM2-135M)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--requests", type=int, default=3, help="concurrent requests per run")
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument(
        "--lease-seconds",
        type=float,
        default=5.0,
        help="the verifier's slot lease: gateway-kill waits for it to run out",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the tallies here")
    parser.add_argument("--log-dir", help="keep the processes' logs here")
    args = parser.parse_args(argv)
    faults = args.faults.split(",")
    unknown = set(faults) - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}; choose from {', '.join(FAULTS)}")
    from lyanna.model.default import fetch_default_model

    model_dir = Path(args.model) if args.model else fetch_default_model()
    tallies = run_faults(
        model_dir,
        faults,
        args.runs,
        method=args.method,
        max_tokens=args.max_tokens,
        requests=args.requests,
        lease_seconds=args.lease_seconds,
        seed=args.seed,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        keep_going=True,
    )
    print(
        f"\n{args.method}, {args.requests} greedy streaming requests of {args.max_tokens} "
        f"tokens per run, over HTTP, lease {args.lease_seconds:g} s\n"
    )
    print(table(tallies))
    for fault, t in tallies.items():
        if fault == "gateway-kill":
            print(
                f"\ngateway-kill: {t.held_at_kill} slots held at the kills, {t.cut_by_kill} "
                f"streams cut, reclaimed after {t.reclaim_seconds} s"
            )
    if args.json:
        Path(args.json).write_text(json.dumps({f: asdict(t) for f, t in tallies.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
