"""From an OpenAI request body to a ``GenerationRequest``: every check that answers 400 / 404
before any work is queued, and tokenization (chat template or raw completion prompt)."""

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
    """The client's ``X-Request-Id`` (checked), else a fresh one."""
    if header is None:
        return uuid.uuid4().hex
    if not REQUEST_ID.fullmatch(header):
        message = "X-Request-Id must be 1 to 128 characters of A-Z a-z 0-9 . _ : -"
        raise invalid(message, "X-Request-Id")
    return header


class RequestBuilder:
    def __init__(self, backend: GenerationBackend, tokenizer: Any, config: GatewayConfig):
        self.backend, self.tokenizer, self.config = backend, tokenizer, config

    async def prepare(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        header_method: str | None,
        request_id: str,
    ) -> Prepared:
        """Check ``body`` (400 / 404 naming the field), tokenize its prompt, pick its method."""
        chat, config = isinstance(body, ChatCompletionRequest), self.config
        if body.model is not None and body.model != config.model_name:
            message = f"The model `{body.model}` does not exist."
            raise APIError(404, message, "model", "model_not_found")
        if body.n not in (None, 1):
            raise invalid("only n=1 is supported", "n")
        for name, no_ops in UNSUPPORTED_NO_OP.items():
            if name in type(body).model_fields and getattr(body, name) not in no_ops:
                raise invalid(f"{name} is not supported", name, "unsupported_parameter")
        stop = body.stop_strings()
        if len(stop) > config.max_stop_strings:
            raise invalid(f"at most {config.max_stop_strings} stop strings", "stop")
        if any(not 0 < len(s) <= config.max_stop_chars for s in stop):
            raise invalid(f"stop strings need 1 to {config.max_stop_chars} characters", "stop")
        if chat and body.top_logprobs is not None and not body.logprobs:
            raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
        if not chat and body.echo:
            raise invalid("echo is not supported", "echo")
        # chat: None = off, k = top_logprobs alternatives; completions: the count itself
        logprobs = ((body.top_logprobs or 0) if body.logprobs else None) if chat else body.logprobs
        if logprobs is not None and not getattr(self.backend, "supports_logprobs", False):
            raise invalid("logprobs are not supported by this deployment mode", "logprobs")
        param = "messages" if chat else "prompt"
        if chat:
            if len(body.messages) > config.max_messages:
                raise invalid(f"at most {config.max_messages} messages", "messages")
            messages = [
                {"role": CHAT_ROLES.get(m.role, m.role), "content": m.text()} for m in body.messages
            ]
            prompt_ids = await asyncio.to_thread(chat_prompt_ids, self.tokenizer, messages)
        elif isinstance(body.prompt, str):
            prompt_ids = await asyncio.to_thread(self.tokenizer.encode, body.prompt)
        else:
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in body.prompt):
                raise invalid(f"prompt token ids must be in [0, {vocab})", "prompt")
            prompt_ids = body.prompt
        prompt_ids = list(prompt_ids)
        method = header_method or body.lyanna_method or self.backend.default_method
        if method not in self.backend.methods:
            choices = list(self.backend.methods)
            message = f"unknown method {method!r}; choose one of {choices}"
            raise invalid(message, "lyanna_method", "unknown_method")
        if not prompt_ids:
            raise invalid("the prompt is empty", param)
        context, num_prompt = self.backend.max_context, len(prompt_ids)
        if num_prompt > config.max_prompt_tokens or num_prompt >= context:
            limit = min(config.max_prompt_tokens, context - 1)
            message = f"the prompt has {num_prompt} tokens; at most {limit} fit"
            raise invalid(message, param, "context_length_exceeded")
        max_tokens = body.requested_max_tokens()
        if max_tokens is None:
            max_tokens = min(config.default_max_tokens, context - num_prompt)
        elif max_tokens > config.max_output_tokens:
            raise invalid(f"max_tokens must be <= {config.max_output_tokens}", "max_tokens")
        elif num_prompt + max_tokens > context:
            message = (
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the context "
                f"of {context} tokens"
            )
            raise invalid(message, "max_tokens", "context_length_exceeded")
        try:
            params = SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                max_tokens=max_tokens,
                seed=None if body.seed is None else unsigned_seed(body.seed),
                stop=stop,
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
        """OpenAI's map of token ids (decimal strings) to biases, checked."""
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
