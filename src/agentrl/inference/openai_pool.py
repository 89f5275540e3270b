"""A pool of OpenAI-compatible chat endpoints with ordered fail-over, for LLM judges and summarisers.

Each call tries the configured ``{model, base_url, api_key}`` entries in order and returns the first successful
completion; when every entry fails it raises :class:`AllModelsFailed` listing each entry's error, so a judge that
cannot answer is reported as such (never silently scored 0). Keys are never logged or put in error messages.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import openai
from openai.types.chat import ChatCompletion
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from agentrl.log import redact

logger = logging.getLogger(__name__)

NO_KEY = "EMPTY"  # what local OpenAI-compatible servers (SGLang, agentrl engine) accept


class ModelEndpoint(BaseModel):
    """One model behind an OpenAI-compatible API. The key comes from ``api_key`` or the ``api_key_env`` variable."""

    model_config = ConfigDict(extra="forbid")

    model: str
    base_url: str
    api_key: SecretStr | None = None
    api_key_env: str | None = Field(None, description="name of an environment variable holding the key")

    @model_validator(mode="after")
    def _one_key_source(self) -> ModelEndpoint:
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError(f"{self.model}: give api_key or api_key_env, not both")
        return self

    def key(self) -> str:
        if self.api_key_env is not None:
            value = os.environ.get(self.api_key_env)
            if not value:
                raise ValueError(f"{self.model}: environment variable {self.api_key_env} is not set")
            return value
        return self.api_key.get_secret_value() if self.api_key is not None else NO_KEY

    def label(self) -> str:
        return f"{self.model} at {redact(self.base_url)}"


class AllModelsFailed(RuntimeError):
    """No endpoint of the pool produced a completion; ``errors`` holds ``(endpoint label, error)`` pairs."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = errors
        details = "; ".join(f"{label}: {message}" for label, message in errors)
        super().__init__(f"all {len(errors)} model endpoint(s) failed: {details}")


class OpenAIPool:
    """Chat completions with ordered fail-over across ``endpoints``.

    ``timeout_s`` bounds each attempt; ``max_retries`` is the OpenAI client's own retry count per endpoint
    (on connection errors, 408/409/429 and 5xx) before moving on to the next endpoint.
    """

    def __init__(self, endpoints: Sequence[ModelEndpoint | dict[str, Any]], *, timeout_s: float = 120.0,
                 max_retries: int = 1):
        self.endpoints = [e if isinstance(e, ModelEndpoint) else ModelEndpoint.model_validate(e) for e in endpoints]
        if not self.endpoints:
            raise ValueError("an OpenAI pool needs at least one {model, base_url, api_key} entry")
        self._clients = [openai.AsyncOpenAI(base_url=e.base_url, api_key=e.key(), timeout=timeout_s,
                                            max_retries=max_retries) for e in self.endpoints]

    async def __aenter__(self) -> OpenAIPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for client in self._clients:
            await client.close()

    async def chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> ChatCompletion:
        """``chat.completions.create`` on the first endpoint that answers; ``model`` is set per endpoint."""
        errors: list[tuple[str, str]] = []
        for endpoint, client in zip(self.endpoints, self._clients, strict=True):
            try:
                completion = await client.chat.completions.create(model=endpoint.model, messages=messages, **kwargs)
            except openai.OpenAIError as error:
                message = redact(f"{type(error).__name__}: {error}")
            else:
                if completion.choices:
                    return completion
                message = "the response has no choices"
            logger.warning("model endpoint %s failed (%s); trying the next one", endpoint.label(), message)
            errors.append((endpoint.label(), message))
        raise AllModelsFailed(errors)

    async def chat_text(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        """The text of the first choice of :meth:`chat` (empty string when the model returned no text)."""
        completion = await self.chat(messages, **kwargs)
        return completion.choices[0].message.content or ""
