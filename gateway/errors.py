"""OpenAI-format errors: one exception type the routes raise and the handlers that turn every
failure (validation, unknown routes, backend busy or down) into
``{"error": {"message", "type", "param", "code"}}`` with the right status.

FastAPI answers invalid bodies with 422; OpenAI clients expect 400, so validation errors
(malformed JSON included) are rewritten here, naming the offending field in ``param`` (an
unknown field is "Unrecognized request argument supplied", as OpenAI words it). Every 429
carries ``Retry-After`` (seconds), the busy backend's included.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.backend import BackendBusy, BackendUnavailable

logger = logging.getLogger(__name__)
BUSY_RETRY_AFTER_SECONDS = 1  # a full queue drains within a few steps; clients back off

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


@dataclass(eq=False)
class APIError(Exception):
    """An error the client sees as an OpenAI error body."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, headers)


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }
    return JSONResponse(body, status_code=status, headers=headers)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def _validation_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": (), "type": "invalid"}
    if first.get("type") == "json_invalid":
        return error_response(400, f"malformed JSON body: {first.get('msg')}", None, "json_invalid")
    param = _validation_param(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden":
        return error_response(
            400, f"Unrecognized request argument supplied: {param}", param, "unsupported_parameter"
        )
    message = f"{param}: {first['msg']}" if param else str(first["msg"])
    if first.get("type") == "missing" and not param:
        message = "request body is required"
    return error_response(400, message, param, first.get("type"))


async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
    return error_response(
        exc.status_code, str(exc.detail), None, codes.get(exc.status_code), exc.headers
    )


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _on_busy(request: Request, exc: BackendBusy) -> JSONResponse:
    return error_response(
        429,
        str(exc) or "the waiting queue is full",
        None,
        "queue_full",
        headers={"Retry-After": str(BUSY_RETRY_AFTER_SECONDS)},
    )


async def _on_unavailable(request: Request, exc: BackendUnavailable) -> JSONResponse:
    message = str(exc) or "the backend is unavailable"
    return error_response(503, message, None, "backend_unavailable")


def stream_error(err: Exception) -> dict:
    """The SSE event for a stream that failed after its headers went out: the message of an
    error meant for clients, a generic one (the details logged) for anything else."""
    if isinstance(err, (APIError, BackendBusy, BackendUnavailable, ValueError)):
        message = str(err)
    else:
        logger.error("stream failed", exc_info=err)
        message = "internal error (logged)"
    return {"error": {"message": message, "type": "server_error", "code": None}}


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(BackendBusy, _on_busy)
    app.add_exception_handler(BackendUnavailable, _on_unavailable)
