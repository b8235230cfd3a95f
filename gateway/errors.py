"""OpenAI-format errors: every failure (validation, unknown routes, backend busy or down)
becomes ``{"error": {"message", "type", "param", "code"}}`` with the right status.

OpenAI clients expect 400 where FastAPI answers 422, so validation errors (malformed JSON
included) are rewritten, naming the offending field in ``param``. Every 429 carries
``Retry-After``."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lyanna.async_engine import BackendBusy, BackendUnavailable

logger = logging.getLogger(__name__)
BUSY_RETRY_AFTER_SECONDS = 1  # a full queue drains within a few steps; clients back off
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


@dataclass(eq=False)
class APIError(Exception):
    """An error the client sees as an OpenAI error body."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "invalid_request_error")
    body = {"message": message, "type": kind, "param": param, "code": code}
    return JSONResponse({"error": body}, status_code=status, headers=headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": (), "type": "invalid"}
    kind = first.get("type")
    if kind == "json_invalid":
        return error_response(400, f"malformed JSON body: {first.get('msg')}", None, kind)
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    if kind == "extra_forbidden":  # as OpenAI words it
        message = f"Unrecognized request argument supplied: {param}"
        return error_response(400, message, param, "unsupported_parameter")
    message = f"{param}: {first['msg']}" if param else str(first["msg"])
    if kind == "missing" and not param:
        message = "request body is required"
    return error_response(400, message, param, kind)


def stream_error(err: Exception) -> dict:
    """The SSE event of a stream that failed after its headers went out: the message of an
    error meant for clients, a generic one (the details logged) for anything else."""
    if isinstance(err, (APIError, BackendBusy, BackendUnavailable, ValueError)):
        message = str(err)
    else:
        logger.error("stream failed", exc_info=err)
        message = "internal error (logged)"
    return {"error": {"message": message, "type": "server_error", "code": None}}


def install_error_handlers(app: FastAPI) -> None:
    def handler(kind: type, answer) -> None:
        async def handle(request: Request, exc: Exception) -> JSONResponse:
            return answer(exc)

        app.add_exception_handler(kind, handle)

    app.add_exception_handler(RequestValidationError, _on_validation)
    handler(
        StarletteHTTPException,
        lambda e: error_response(
            e.status_code, str(e.detail), None, HTTP_CODES.get(e.status_code), e.headers
        ),
    )
    handler(APIError, lambda e: error_response(e.status, e.message, e.param, e.code))
    retry = {"Retry-After": str(BUSY_RETRY_AFTER_SECONDS)}
    busy = "the waiting queue is full"
    handler(BackendBusy, lambda e: error_response(429, str(e) or busy, None, "queue_full", retry))
    down = "the backend is unavailable"
    handler(
        BackendUnavailable,
        lambda e: error_response(503, str(e) or down, None, "backend_unavailable"),
    )
