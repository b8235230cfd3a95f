"""From an OpenAI request body to a ``GenerationRequest``: every check that answers 400 / 404
before any work is queued (model, n, unsupported parameters, logits processors against the
vocabulary, stop strings, method, prompt and output lengths against the backend's context,
the client's ``X-Request-Id``), and tokenization (chat template or raw completion prompt)."""

from __future__ import annotations

import asyncio
import re
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.backend import GenerationBackend, GenerationRequest
from gateway.config import GatewayConfig
from gateway.errors import APIError, invalid
from gateway.schemas import UNSUPPORTED_NO_OP, ChatCompletionRequest, CompletionRequest
from lyanna.sampling import SamplingParams, unsigned_seed
from lyanna.tokenizer import chat_prompt_ids

METHOD_HEADER = "x-lyanna-method"
REQUEST_ID_HEADER = "x-request-id"
# a client's request id is echoed in a header and in the response id: bounded, header-safe
REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
CHAT_ROLES = {"developer": "system"}  # roles the chat template knows under another name


@dataclass(frozen=True, slots=True)
class Prepared:
    request: GenerationRequest
    method: str
    logprobs: int | None = None  # chat logprobs: None = off, k = top_logprobs alternatives


def request_id_of(header: str | None) -> str:
    """The client's ``X-Request-Id`` when it sent one (400 unless it is 1-128 characters of
    ``[A-Za-z0-9._:-]``), else a fresh one."""
    if header is None:
        return uuid.uuid4().hex
    if not REQUEST_ID.fullmatch(header):
        raise invalid(
            "X-Request-Id must be 1 to 128 characters of A-Z a-z 0-9 . _ : -", "X-Request-Id"
        )
    return header


class RequestBuilder:
    def __init__(self, backend: GenerationBackend, tokenizer: Any, config: GatewayConfig):
        self.backend, self.tokenizer, self.config = backend, tokenizer, config

    async def chat(
        self, body: ChatCompletionRequest, header_method: str | None, request_id: str
    ) -> Prepared:
        self._check_common(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
        if body.logprobs and not getattr(self.backend, "supports_logprobs", False):
            raise invalid("logprobs are not supported by this deployment mode", "logprobs")
        if len(body.messages) > self.config.max_messages:
            raise invalid(f"at most {self.config.max_messages} messages", "messages")
        messages = [
            {"role": CHAT_ROLES.get(m.role, m.role), "content": m.text()} for m in body.messages
        ]
        prompt_ids = await asyncio.to_thread(chat_prompt_ids, self.tokenizer, messages)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return self._prepare(body, prompt_ids, "messages", header_method, request_id, logprobs)

    async def completion(
        self, body: CompletionRequest, header_method: str | None, request_id: str
    ) -> Prepared:
        self._check_common(body)
        if body.echo:
            raise invalid("echo is not supported", "echo")
        if body.logprobs is not None and not getattr(self.backend, "supports_logprobs", False):
            raise invalid("logprobs are not supported by this deployment mode", "logprobs")
        if isinstance(body.prompt, str):
            prompt_ids = await asyncio.to_thread(self.tokenizer.encode, body.prompt)
        else:
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in body.prompt):
                raise invalid(f"prompt token ids must be in [0, {vocab})", "prompt")
            prompt_ids = list(body.prompt)
        return self._prepare(
            body, list(prompt_ids), "prompt", header_method, request_id, body.logprobs
        )

    def _check_common(self, body: ChatCompletionRequest | CompletionRequest) -> None:
        if body.model is not None and body.model != self.config.model_name:
            raise APIError(
                404, f"The model `{body.model}` does not exist.", "model", "model_not_found"
            )
        if body.n not in (None, 1):
            raise invalid("only n=1 is supported", "n")
        for name, no_ops in UNSUPPORTED_NO_OP.items():
            if name in type(body).model_fields and getattr(body, name) not in no_ops:
                raise invalid(f"{name} is not supported", name, "unsupported_parameter")
        stop = body.stop_strings()
        if len(stop) > self.config.max_stop_strings:
            raise invalid(f"at most {self.config.max_stop_strings} stop strings", "stop")
        if any(not 0 < len(s) <= self.config.max_stop_chars for s in stop):
            raise invalid(f"stop strings need 1 to {self.config.max_stop_chars} characters", "stop")

    def _method(self, body_method: str | None, header_method: str | None) -> str:
        method = header_method or body_method or self.backend.default_method
        if method not in self.backend.methods:
            raise invalid(
                f"unknown method {method!r}; choose one of {list(self.backend.methods)}",
                "lyanna_method",
                "unknown_method",
            )
        return method

    def _prepare(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        prompt_ids: list[int],
        prompt_param: str,
        header_method: str | None,
        request_id: str,
        logprobs: int | None = None,
    ) -> Prepared:
        method = self._method(body.lyanna_method, header_method)
        if not prompt_ids:
            raise invalid("the prompt is empty", prompt_param)
        context = self.backend.max_context
        num_prompt = len(prompt_ids)
        if num_prompt > self.config.max_prompt_tokens or num_prompt >= context:
            limit = min(self.config.max_prompt_tokens, context - 1)
            raise invalid(
                f"the prompt has {num_prompt} tokens; at most {limit} fit",
                prompt_param,
                "context_length_exceeded",
            )
        requested = body.requested_max_tokens()
        if requested is None:
            max_tokens = min(self.config.default_max_tokens, context - num_prompt)
        elif requested > self.config.max_output_tokens:
            raise invalid(f"max_tokens must be <= {self.config.max_output_tokens}", "max_tokens")
        elif num_prompt + requested > context:
            raise invalid(
                f"prompt ({num_prompt} tokens) + max_tokens ({requested}) exceeds the context "
                f"of {context} tokens",
                "max_tokens",
                "context_length_exceeded",
            )
        else:
            max_tokens = requested
        try:
            params = SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                max_tokens=max_tokens,
                seed=None if body.seed is None else unsigned_seed(body.seed),
                stop=body.stop_strings(),
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                logit_bias=self._logit_bias(body.logit_bias),
                top_k=max(body.top_k or 0, 0),
                logprobs=logprobs,
            )
        except ValueError as err:
            raise invalid(str(err)) from err
        request = GenerationRequest(request_id, prompt_ids, params, method)
        return Prepared(request, method, logprobs)

    def _logit_bias(self, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        """OpenAI's map of token ids (decimal strings) to biases in [-100, 100], checked
        against the vocabulary (400 naming ``logit_bias``)."""
        if not bias:
            return ()
        vocab = len(self.tokenizer)
        entries = []
        for key, value in bias.items():
            if not key.isascii() or not key.isdigit() or not 0 <= int(key) < vocab:
                raise invalid(f"logit_bias keys must be token ids in [0, {vocab})", "logit_bias")
            if not -100.0 <= value <= 100.0:
                raise invalid("logit_bias values must be in [-100, 100]", "logit_bias")
            entries.append((int(key), float(value)))
        entries.sort()
        if len({t for t, _ in entries}) != len(entries):  # "7" and "07"
            raise invalid("logit_bias names a token id twice", "logit_bias")
        return tuple(entries)
