"""From an OpenAI request body to a ``GenerationRequest``: every check that answers 400 / 404
before any work is queued (model, n, stop strings, method, prompt and output lengths against
the backend's context), and tokenization (chat template or raw completion prompt)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.backend import GenerationBackend, GenerationRequest
from gateway.config import GatewayConfig
from gateway.errors import APIError, invalid
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from lyanna.sampling import SamplingParams
from lyanna.tokenizer import chat_prompt_ids

METHOD_HEADER = "x-lyanna-method"
CHAT_ROLES = {"developer": "system"}  # roles the chat template knows under another name


@dataclass(frozen=True, slots=True)
class Prepared:
    request: GenerationRequest
    method: str


class RequestBuilder:
    def __init__(self, backend: GenerationBackend, tokenizer: Any, config: GatewayConfig):
        self.backend, self.tokenizer, self.config = backend, tokenizer, config

    async def chat(self, body: ChatCompletionRequest, header_method: str | None) -> Prepared:
        self._check_common(body)
        if len(body.messages) > self.config.max_messages:
            raise invalid(f"at most {self.config.max_messages} messages", "messages")
        messages = [
            {"role": CHAT_ROLES.get(m.role, m.role), "content": m.text()} for m in body.messages
        ]
        prompt_ids = await asyncio.to_thread(chat_prompt_ids, self.tokenizer, messages)
        return self._prepare(body, prompt_ids, "messages", header_method)

    async def completion(self, body: CompletionRequest, header_method: str | None) -> Prepared:
        self._check_common(body)
        if body.echo:
            raise invalid("echo is not supported", "echo")
        if isinstance(body.prompt, str):
            prompt_ids = await asyncio.to_thread(self.tokenizer.encode, body.prompt)
        else:
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in body.prompt):
                raise invalid(f"prompt token ids must be in [0, {vocab})", "prompt")
            prompt_ids = list(body.prompt)
        return self._prepare(body, list(prompt_ids), "prompt", header_method)

    def _check_common(self, body: ChatCompletionRequest | CompletionRequest) -> None:
        if body.model is not None and body.model != self.config.model_name:
            raise APIError(
                404, f"The model `{body.model}` does not exist.", "model", "model_not_found"
            )
        if body.n not in (None, 1):
            raise invalid("only n=1 is supported", "n")
        if body.logprobs:
            raise invalid("logprobs are not supported", "logprobs")
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
                seed=body.seed,
                stop=body.stop_strings(),
            )
        except ValueError as err:
            raise invalid(str(err)) from err
        request_id = uuid.uuid4().hex
        return Prepared(GenerationRequest(request_id, prompt_ids, params, method), method)
