"""The OpenAI-compatible HTTP API (FastAPI): chat and text completions (streaming as SSE),
models, health and Prometheus metrics, in front of any ``GenerationBackend``.

The gateway owns the request lifecycle: it validates and tokenizes (``intake``), waits for the
first delta before answering (so a full queue is a 429 and a dead backend a 503, never a
broken stream), streams text with stop strings applied (``generation``), and records metrics.
An ASGI guard in front of every route checks the API key (``LYANNA_API_KEYS``) on ``/v1/``,
bounds the body size and counts every response by path and status code. The method of one
request may be chosen with the ``X-Lyanna-Method`` header or the ``lyanna_method`` body field.
Chat and text completions share one code path (``serve``); a ``Surface`` holds what differs.
A client's ``X-Request-Id`` is echoed and carried by the response id (``chatcmpl-<id>``).
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
from gateway.backend import BackendBusy, GenerationBackend, TokenDelta
from gateway.config import GatewayConfig
from gateway.errors import (
    APIError,
    error_response,
    install_error_handlers,
    invalid,
    stream_error,
)
from gateway.generation import ClientGone, Generation, unless_disconnected
from gateway.intake import (
    METHOD_HEADER,
    REQUEST_ID_HEADER,
    Prepared,
    RequestBuilder,
    request_id_of,
)
from gateway.metrics import GatewayMetrics, RequestTracker
from gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_logprobs,
    completion_response,
    usage,
)
from gateway.text import TextStream, make_detokenize

SSE_DONE = "data: [DONE]\n\n"
API_KEY_STATE = "lyanna_api_key"  # the matched key, in the request's scope state
METHOD_STATE = "lyanna_method"  # the request's method once the intake chose it (metrics)
# component states under which the gateway still serves (a drafter in fallback: target-only)
SERVING_STATES = ("degraded:", "fallback:")


@dataclass(frozen=True, slots=True)
class Surface:
    """What the chat and text completion routes do differently: the id prefix and the
    shapes of a whole answer and of each stream chunk (``with_usage``: chunks carry a
    ``usage`` field; ``lp``: a chat ``logprobs`` object or None)."""

    prefix: str
    logprobs: Callable[[list, int], tuple[dict, int]]  # (entries, offset) -> (body, offset)
    whole: Callable[[str, str, str, dict, dict | None], dict]
    opening: Callable[[str, bool], list[dict]]
    piece: Callable[[str, str, bool, dict | None], dict]
    final: Callable[[str, str | None, bool, dict | None], dict]
    usage_only: Callable[[str, dict], dict]


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class Guard:
    """ASGI middleware: API keys on ``/v1/`` routes (and ``/metrics`` when configured), each
    key's requests in flight and tokens per minute bounded, a bound on request body bytes,
    and every response counted by path and status code (its own refusals included)."""

    def __init__(
        self, app, config: GatewayConfig, tokens: TokenRateLimiter, metrics: GatewayMetrics
    ) -> None:
        self.app, self.config, self.metrics = app, config, metrics
        self._keys = KeyRing(config.api_keys, config.api_keys_file)
        self._streams = StreamLimiter(config.max_streams_per_key)
        self._tokens = tokens  # charged by the routes when a request finishes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})  # shared with the routes (METHOD_STATE)

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                method = state.get(METHOD_STATE)
                self.metrics.response(scope["path"], message["status"], method)
            await send(message)

        await self._guarded(scope, receive, counted)

    async def _guarded(self, scope, receive, send) -> None:
        headers = dict(scope.get("headers", ()))
        path = scope["path"]
        guarded = path.startswith("/v1/") or (path == "/metrics" and self.config.metrics_need_key)
        key = None
        if self._keys.enabled and guarded:
            key = self._keys.match(headers.get(b"authorization", b""))
            if key is None:
                response = error_response(
                    401,
                    "Incorrect or missing API key.",
                    None,
                    "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await response(scope, receive, send)
                return
        if key is not None and path.startswith("/v1/"):
            wait = self._tokens.retry_after(key)
            if wait:
                limit = self._tokens.limit
                response = error_response(
                    429,
                    f"this API key used its {limit} tokens per minute; retry in {wait} s",
                    None,
                    "rate_limit_exceeded",
                    headers={"Retry-After": str(wait)},
                )
                self.metrics.reject("rate_limit_exceeded")
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})[API_KEY_STATE] = key  # the routes charge it
            if not self._streams.acquire(key):
                limit = self._streams.limit
                response = error_response(
                    429,
                    f"this API key already has {limit} requests in flight",
                    None,
                    "too_many_requests",
                    headers={"Retry-After": "1"},
                )
                self.metrics.reject("too_many_requests")
                await response(scope, receive, send)
                return
            try:
                await self._bounded(scope, receive, send, headers)
            finally:
                self._streams.release(key)
            return
        await self._bounded(scope, receive, send, headers)

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
    created = int(time.time())

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
    app.add_middleware(Guard, config=config, tokens=tokens, metrics=metrics)
    install_error_handlers(app)
    app.state.metrics, app.state.backend = metrics, backend

    async def start(request: Request, prepared: Prepared) -> Generation:
        """Queue the request and wait for its first delta (errors here become 4xx/5xx)."""
        tracker = RequestTracker(metrics, prepared.method)
        deltas = backend.generate(prepared.request)
        try:
            first: TokenDelta = await unless_disconnected(request, anext(deltas))
        except ValueError as err:
            tracker.finish("error")
            raise invalid(str(err)) from err
        except ClientGone:
            tracker.finish("abort")
            raise
        except BackendBusy:
            tracker.reject("queue_full")  # a refusal, not a failure: counted apart
            raise
        except BaseException:
            tracker.finish("error")
            raise
        stop = prepared.request.params.stop
        key = request.scope.get("state", {}).get(API_KEY_STATE)
        charge = None if key is None else partial(tokens.charge, key)
        return Generation(deltas, first, TextStream(detokenize, stop), tracker, charge)

    def headers(prepared: Prepared, generation: Generation | None = None) -> dict[str, str]:
        out = {"X-Lyanna-Method": prepared.method, "X-Request-Id": prepared.request.request_id}
        if generation is not None:
            out["X-Lyanna-Acceptance-Length"] = f"{generation.tracker.acceptance_length:.4f}"
        return out

    def usage_of(generation: Generation) -> dict:
        tracker = generation.tracker
        return usage(
            tracker.num_prompt_tokens, tracker.num_output_tokens, generation.spec_summary()
        )

    def token_text(token: int) -> str:
        return detokenize([token])

    def chat_lp(entries: list, offset: int) -> tuple[dict, int]:
        return chat_logprobs(entries, token_text), offset

    def completion_lp(entries: list, offset: int) -> tuple[dict, int]:
        body = completion_logprobs(entries, token_text, offset)
        return body, offset + sum(len(t) for t in body["tokens"])

    model = config.model_name
    surfaces = {
        "chat": Surface(
            prefix="chatcmpl",
            logprobs=chat_lp,
            whole=lambda rid, text, finish, use, lp: chat_response(
                rid, model, text, finish, use, lp
            ),
            opening=lambda rid, with_usage: [
                chat_chunk(rid, model, {"role": "assistant", "content": ""}, None, None, with_usage)
            ],
            piece=lambda rid, text, with_usage, lp: chat_chunk(
                rid, model, {"content": text}, None, None, with_usage, lp
            ),
            final=lambda rid, finish, with_usage, lp: chat_chunk(
                rid, model, {}, finish, None, with_usage, lp
            ),
            usage_only=lambda rid, use: chat_chunk(rid, model, None, None, use, True),
        ),
        "completion": Surface(
            prefix="cmpl",
            logprobs=completion_lp,
            whole=lambda rid, text, finish, use, lp: completion_response(
                rid, model, text, finish, use, lp
            ),
            opening=lambda rid, with_usage: [],
            piece=lambda rid, text, with_usage, lp: completion_response(
                rid, model, text, None, None, lp
            ),
            final=lambda rid, finish, with_usage, lp: completion_response(
                rid, model, "", finish, None, lp
            ),
            usage_only=lambda rid, use: {
                **completion_response(rid, model, "", None, use),
                "choices": [],
            },
        ),
    }

    async def serve(
        request: Request, body: ChatCompletionRequest | CompletionRequest, surface: Surface
    ) -> Response:
        """The one code path of both generation routes: intake, queueing, then a whole
        answer or an SSE stream; ``surface`` holds what differs (ids and body shapes)."""
        request_id = request_id_of(request.headers.get(REQUEST_ID_HEADER))
        header_method = request.headers.get(METHOD_HEADER)
        if isinstance(body, ChatCompletionRequest):
            prepared = await builder.chat(body, header_method, request_id)
        else:
            prepared = await builder.completion(body, header_method, request_id)
        request.scope.setdefault("state", {})[METHOD_STATE] = prepared.method
        # the response id carries the request id, so a client's X-Request-Id finds its answer
        rid = f"{surface.prefix}-{request_id}"
        with_usage = body.include_usage
        offset = 0  # characters of output the logprobs covered so far (completions' offsets)

        def logprobs_of(entries: list) -> dict | None:
            nonlocal offset
            if prepared.logprobs is None:
                return None
            body, offset = surface.logprobs(entries, offset)
            return body

        async def chunks(generation: Generation) -> AsyncIterator[str]:
            for opening in surface.opening(rid, with_usage):
                yield sse(opening)
            try:
                async for piece in generation.texts():
                    lp = logprobs_of(generation.unsent_logprobs())
                    yield sse(surface.piece(rid, piece, with_usage, lp))
            except (APIError, RuntimeError, ValueError) as err:
                yield sse(stream_error(err))
                yield SSE_DONE
                return
            lp = logprobs_of(generation.unsent_logprobs())
            yield sse(surface.final(rid, generation.finish_reason, with_usage, lp))
            if with_usage:
                yield sse(surface.usage_only(rid, usage_of(generation)))
            yield SSE_DONE

        try:
            generation = await start(request, prepared)
            if body.stream:
                return StreamingResponse(
                    chunks(generation),
                    media_type="text/event-stream",
                    headers={**headers(prepared), "Cache-Control": "no-cache"},
                    background=BackgroundTask(generation.close),
                )
            text = await unless_disconnected(request, generation.collect())
        except ClientGone:
            return Response(status_code=499)
        finish = generation.finish_reason or "stop"
        lp = logprobs_of(generation.logprobs)
        answer = surface.whole(rid, text, finish, usage_of(generation), lp)
        return JSONResponse(answer, headers=headers(prepared, generation))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serve(request, body, surfaces["chat"])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serve(request, body, surfaces["completion"])

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model}")
    async def get_model(model: str) -> dict:
        if model != config.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
        return model_card()

    def model_card() -> dict:
        return {
            "id": config.model_name,
            "object": "model",
            "created": created,
            "owned_by": "lyanna",
            "max_model_len": backend.max_context,
            "lyanna_methods": list(backend.methods),
            "lyanna_default_method": backend.default_method,
        }

    @app.get("/health")
    async def health() -> JSONResponse:
        components = await backend.health()
        serving = all(v == "ok" or v.startswith("degraded:") for v in components.values())
        body = {"status": "ok" if serving else "unavailable", "components": components}
        return JSONResponse(body, status_code=200 if serving else 503)

    @app.get("/livez")
    async def livez() -> dict:
        """Liveness: the process answers (never its peers' state: a verifier outage must
        not get the gateway restarted)."""
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        """Readiness: the gateway can serve, target-only included (a drafter in fallback is
        not a reason to take it out of rotation; a verifier outage is)."""
        components = await backend.health()
        ready = all(v == "ok" or v.startswith(SERVING_STATES) for v in components.values())
        body = {"status": "ready" if ready else "unavailable", "components": components}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if config.metrics_port >= 0:  # exported on its own port (LYANNA_METRICS_PORT)
            raise HTTPException(404, "Not Found")
        content, content_type = metrics.exposition()
        return Response(content, media_type=content_type)

    return app
