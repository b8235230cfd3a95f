"""The OpenAI-compatible HTTP API (FastAPI): chat and text completions (streaming as SSE),
models, health and Prometheus metrics, in front of any ``GenerationBackend``.

A request is validated and tokenized (``intake``), then the route waits for its first delta
before answering, so a full queue is a 429 and a dead backend a 503, never a broken stream.
``Guard``, in front of every route, drains (``gateway.server``), checks API keys and per-key
limits on ``/v1/``, bounds the body and counts every response. ``X-Lyanna-Method`` or
``lyanna_method`` picks one request's method; a client's ``X-Request-Id`` is echoed and
carried by the response id.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from gateway.auth import KeyRing, StreamLimiter, TokenRateLimiter
from gateway.backend import GenerationBackend
from gateway.config import GatewayConfig
from gateway.errors import APIError, error_response, install_error_handlers, invalid, stream_error
from gateway.intake import METHOD_HEADER, REQUEST_ID_HEADER, RequestBuilder, request_id_of
from gateway.metrics import GatewayMetrics, RequestTracker
from gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    response,
)
from gateway.text import ClientGone, Generation, unless_disconnected
from lyanna.async_engine import BackendBusy
from lyanna.stop_strings import TextStream
from lyanna.tokenizer import make_detokenize

SSE_DONE = "data: [DONE]\n\n"
API_KEY_STATE = "lyanna_api_key"  # the matched key, in the request's scope state
METHOD_STATE = "lyanna_method"  # the request's method once the intake chose it (metrics)
# component states under which the gateway still serves (a drafter in fallback: target-only)
SERVING_STATES = ("degraded:", "fallback:")
PROBE_PATHS = frozenset({"/livez", "/health", "/metrics"})  # answer while draining


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


@dataclass(slots=True)
class Drain:
    """Shared by ``Guard`` and the server that drains: once ``draining``, ``/readyz`` and new
    API requests get 503; ``in_flight`` counts API requests (a stream until its last byte)."""

    draining: bool = False
    in_flight: int = 0


class Guard:
    """ASGI middleware: the drain, API keys on ``/v1/`` (and ``/metrics`` if configured), each
    key's requests in flight and tokens per minute, body bytes; counts every response."""

    def __init__(
        self,
        app,
        config: GatewayConfig,
        tokens: TokenRateLimiter,
        metrics: GatewayMetrics,
        drain: Drain,
    ) -> None:
        self.app, self.config, self.metrics, self.drain = app, config, metrics, drain
        self._keys = KeyRing(config.api_keys, config.api_keys_file)
        self._streams = StreamLimiter(config.max_streams_per_key)
        self._tokens = tokens  # charged by the routes when a request finishes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})  # shared with the routes

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.response(scope["path"], message["status"], state.get(METHOD_STATE))
            await send(message)

        async def refuse(status: int, message: str, code: str, headers: dict) -> None:
            if status == 429:
                self.metrics.reject(code)
            await error_response(status, message, None, code, headers)(scope, receive, counted)

        path = scope["path"]
        if self.drain.draining and path == "/readyz":
            await JSONResponse({"status": "draining"}, 503)(scope, receive, counted)
        elif self.drain.draining and path not in PROBE_PATHS:
            message = "the server is shutting down; retry on another replica"
            await refuse(503, message, "draining", {"Retry-After": "1"})
        else:
            request = path not in PROBE_PATHS and path != "/readyz"  # in flight while it runs
            self.drain.in_flight += request
            try:
                await self._guard(scope, receive, counted, refuse, state)
            finally:
                self.drain.in_flight -= request

    async def _guard(self, scope, receive, counted, refuse, state: dict) -> None:
        path = scope["path"]
        headers = dict(scope.get("headers", ()))
        guarded = path.startswith("/v1/") or (path == "/metrics" and self.config.metrics_need_key)
        key = None
        if self._keys.enabled and guarded:
            key = self._keys.match(headers.get(b"authorization", b""))
            if key is None:
                auth = {"WWW-Authenticate": "Bearer"}
                await refuse(401, "Incorrect or missing API key.", "invalid_api_key", auth)
                return
        if key is None or not path.startswith("/v1/"):
            await self._bounded(scope, receive, counted, headers)
            return
        wait = self._tokens.retry_after(key)
        if wait:
            message = f"this API key used its {self._tokens.limit} tokens per minute"
            retry = {"Retry-After": str(wait)}
            await refuse(429, f"{message}; retry in {wait} s", "rate_limit_exceeded", retry)
            return
        state[API_KEY_STATE] = key  # the routes charge it
        if not self._streams.acquire(key):
            message = f"this API key already has {self._streams.limit} requests in flight"
            await refuse(429, message, "too_many_requests", {"Retry-After": "1"})
            return
        try:
            await self._bounded(scope, receive, counted, headers)
        finally:
            self._streams.release(key)

    async def _bounded(self, scope, receive, send, headers: dict[bytes, bytes]) -> None:
        limit = self.config.max_body_bytes
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > limit:
            message = f"request body exceeds {limit} bytes" if declared.isdigit() else "bad length"
            await error_response(413, message, None, "request_too_large")(scope, receive, send)
            return
        received = 0

        async def bounded_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                raise HTTPException(413, f"request body exceeds {limit} bytes")
            return message

        await self.app(scope, bounded_receive, send)


def create_app(
    backend: GenerationBackend,
    tokenizer: Any,
    config: GatewayConfig,
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    """The app; ``on_ready`` runs once the backend has started (the CLI prints the URL)."""
    metrics = GatewayMetrics(config.model_name, config.mode)
    builder = RequestBuilder(backend, tokenizer, config)
    created, model = int(time.time()), config.model_name
    detokenize = make_detokenize(tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await backend.start()
        metrics.prime(backend.default_method)
        exporter = metrics.serve(config.host, config.metrics_port)  # None: on the API port
        if on_ready is not None:
            on_ready()
        yield
        if exporter is not None:
            exporter.shutdown()
        await backend.stop()

    hidden = {} if config.openapi else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="Lyanna", version="0.1.0", lifespan=lifespan, **hidden)
    tokens = TokenRateLimiter(config.max_tokens_per_minute_per_key)
    app.state.metrics, app.state.backend, app.state.drain = metrics, backend, Drain()
    app.add_middleware(Guard, config=config, tokens=tokens, metrics=metrics, drain=app.state.drain)
    install_error_handlers(app)

    async def serve(request: Request, body: ChatCompletionRequest | CompletionRequest) -> Response:
        """Both generation routes: intake, queueing, then a whole answer or an SSE stream."""
        chat = isinstance(body, ChatCompletionRequest)
        request_id = request_id_of(request.headers.get(REQUEST_ID_HEADER))
        prepared = await builder.prepare(body, request.headers.get(METHOD_HEADER), request_id)
        state = request.scope.setdefault("state", {})
        state[METHOD_STATE] = prepared.method
        headers = {"X-Lyanna-Method": prepared.method, "X-Request-Id": request_id}
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"  # finds the client's answer
        with_usage = body.include_usage
        offset = 0  # characters of output the logprobs covered so far (completions' offsets)

        def logprobs_of(entries: list) -> dict | None:
            nonlocal offset
            if prepared.logprobs is None:
                return None
            if chat:
                return chat_logprobs(entries, lambda token: detokenize([token]))
            lp = completion_logprobs(entries, lambda token: detokenize([token]), offset)
            offset += sum(len(t) for t in lp["tokens"])
            return lp

        kind = "chat.completion" if chat else "text_completion"
        chunk_kind = f"{kind}.chunk" if chat else kind
        null_usage = {"usage": None} if chat and with_usage else {}  # on every chat chunk

        def chunk(text: str, finish: str | None, lp: dict | None, delta: dict | None = None):
            if chat:  # the opening chunk's delta names the role, the final one is empty
                content = {"delta": delta or ({"content": text} if text else {})}
            else:
                content = {"text": text}
            choice = {**content, "logprobs": lp, "finish_reason": finish}
            return response(rid, model, chunk_kind, choice, **null_usage)

        async def chunks(generation: Generation) -> AsyncIterator[str]:
            if chat:
                yield sse(chunk("", None, None, {"role": "assistant", "content": ""}))
            try:
                async for piece in generation.texts():
                    yield sse(chunk(piece, None, logprobs_of(generation.unsent_logprobs())))
            except (APIError, RuntimeError, ValueError) as err:
                yield sse(stream_error(err))
                yield SSE_DONE
                return
            lp = logprobs_of(generation.unsent_logprobs())
            yield sse(chunk("", generation.finish_reason, lp))
            if with_usage:
                yield sse(response(rid, model, chunk_kind, None, usage=generation.usage()))
            yield SSE_DONE

        tracker = RequestTracker(metrics, prepared.method)
        deltas = backend.generate(prepared.request)
        try:  # the first delta: errors here become 4xx / 5xx answers
            first = await unless_disconnected(request, anext(deltas))
        except ValueError as err:
            tracker.finish("error")
            raise invalid(str(err)) from err
        except ClientGone:
            tracker.finish("abort")
            return Response(status_code=499)
        except BackendBusy:
            tracker.reject("queue_full")  # a refusal, not a failure: counted apart
            raise
        except BaseException:
            tracker.finish("error")
            raise
        key = state.get(API_KEY_STATE)
        charge = None if key is None else partial(tokens.charge, key)
        text = TextStream(detokenize, prepared.request.params.stop)
        generation = Generation(deltas, first, text, tracker, charge)
        if body.stream:
            return StreamingResponse(
                chunks(generation),
                media_type="text/event-stream",
                headers={**headers, "Cache-Control": "no-cache"},
                background=BackgroundTask(generation.close),
            )
        try:
            text = await unless_disconnected(request, generation.collect())
        except ClientGone:
            return Response(status_code=499)
        content = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        finish, lp = generation.finish_reason or "stop", logprobs_of(generation.logprobs)
        choice = {**content, "logprobs": lp, "finish_reason": finish}
        answer = response(rid, model, kind, choice, usage=generation.usage())
        headers["X-Lyanna-Acceptance-Length"] = f"{tracker.acceptance_length:.4f}"
        return JSONResponse(answer, headers=headers)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serve(request, body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serve(request, body)

    def model_card() -> dict:
        return {
            "id": model,
            "object": "model",
            "created": created,
            "owned_by": "lyanna",
            "max_model_len": backend.max_context,
            "lyanna_methods": list(backend.methods),
            "lyanna_default_method": backend.default_method,
        }

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model}")
    async def get_model(model: str) -> dict:
        if model != config.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
        return model_card()

    async def probe(ok: str, states: tuple[str, ...]) -> JSONResponse:
        components = await backend.health()
        serving = all(v == "ok" or v.startswith(states) for v in components.values())
        body = {"status": ok if serving else "unavailable", "components": components}
        return JSONResponse(body, status_code=200 if serving else 503)

    @app.get("/health")
    async def health() -> JSONResponse:
        return await probe("ok", ("degraded:",))

    @app.get("/livez")
    async def livez() -> dict:
        """The process answers (never its peers' state: a verifier outage must not get the
        gateway restarted)."""
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        """Target-only serving is ready (a drafter in fallback is no reason to leave the
        rotation; a verifier outage is)."""
        return await probe("ready", SERVING_STATES)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if config.metrics_port >= 0:  # exported on its own port (LYANNA_METRICS_PORT)
            raise HTTPException(404, "Not Found")
        content, content_type = metrics.exposition()
        return Response(content, media_type=content_type)

    return app
