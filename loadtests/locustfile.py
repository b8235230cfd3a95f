"""The load harness's workload for Locust (``pip install locust``; not a dependency, not run
in CI): each simulated user streams chat completions of the scenario prompts at temperature 0
and reports time to first token and the full request as separate Locust entries.

    locust -f loadtests/locustfile.py --host http://127.0.0.1:8000 --users 16 --spawn-rate 4 \
        --run-time 2m --headless
"""

from __future__ import annotations

import itertools
import json
import os
import time

from locust import HttpUser, between, task

from loadtests.load import load_prompts

PROMPTS = itertools.cycle(
    load_prompts(os.environ.get("LYANNA_LOAD_DATASET", "") or "loadtests/scenarios/chat.jsonl")
)
MAX_TOKENS = int(os.environ.get("LYANNA_LOAD_MAX_TOKENS", "64"))
API_KEY = os.environ.get("LYANNA_LOAD_API_KEY", "none")


class ChatUser(HttpUser):
    wait_time = between(0.0, 0.5)
    model = ""

    def on_start(self) -> None:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        self.model = self.client.get("/v1/models", headers=headers).json()["data"][0]["id"]

    @task
    def stream_chat(self) -> None:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": next(PROMPTS)}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": True,
        }
        headers = {"Authorization": f"Bearer {API_KEY}"}
        start = time.perf_counter()
        first = None
        with self.client.post(
            "/v1/chat/completions",
            json=body,
            headers=headers,
            stream=True,
            catch_response=True,
            name="chat (stream)",
        ) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}")
                return
            for line in response.iter_lines():
                if first is None and line.startswith(b"data: {"):
                    delta = json.loads(line[6:])["choices"]
                    if delta and delta[0]["delta"].get("content"):
                        first = time.perf_counter()
            response.success()
        if first is not None:
            self.environment.events.request.fire(
                request_type="TTFT",
                name="chat first token",
                response_time=(first - start) * 1e3,
                response_length=0,
                exception=None,
                context={},
            )
