"""The agent config (``--agent_config_path``, see ``assets/agent_config_example.yml``): LLMs AgentRL calls besides
the policy, over any OpenAI-compatible endpoint.

- ``scorer_agent``: the LLM judge of the ``agentcpm`` scorer;
- ``browse_agent``: the summariser of the ``--new_context discard_all`` context strategy (its only use here).

Each lists ``models`` in fail-over order. API keys never appear in the file: ``api_key_env`` names the
environment variable that holds the key (no variable: the endpoint needs no key).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agentrl.scoring.errors import DEFAULT_UNAVAILABLE_RETRY_S

REQUIRED_JUDGE_PLACEHOLDERS = ("{labeled_answer}", "{pred_answer}")


class AgentConfigError(ValueError):
    """The agent config file is missing or invalid."""


class LLMEndpoint(BaseModel):
    """One model behind an OpenAI-compatible endpoint."""

    model_config = ConfigDict(extra="forbid")

    base_url: str = Field(description="e.g. https://api.openai.com/v1 or http://127.0.0.1:30000/v1")
    model: str
    api_key_env: str | None = Field(None, description="environment variable holding the API key")

    @model_validator(mode="before")
    @classmethod
    def _no_literal_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "api_key" in data:
            raise ValueError(
                "'api_key' is not accepted in the agent config (secrets stay out of files): put the key in an "
                "environment variable and name it with 'api_key_env'"
            )
        return data

    def api_key(self) -> str:
        """The key from ``api_key_env`` (``KeyError`` if that variable is unset); ``"EMPTY"`` without one."""
        if self.api_key_env is None:
            return "EMPTY"
        value = os.environ.get(self.api_key_env)
        if not value:
            raise KeyError(f"environment variable {self.api_key_env} (API key of {self.model}) is not set")
        return value


class LLMPoolConfig(BaseModel):
    """Models tried in order: each gets ``max_retries`` attempts, ``retry_delay`` * ``backoff_factor``^k apart."""

    model_config = ConfigDict(extra="forbid")

    models: list[LLMEndpoint] = Field(min_length=1)
    max_retries: int = Field(2, ge=1, description="attempts per model before failing over to the next")
    retry_delay: float = Field(1.0, ge=0)
    backoff_factor: float = Field(2.0, ge=1)
    timeout: float = Field(60.0, gt=0, description="seconds per request")
    extra_body: dict[str, Any] = Field(default_factory=dict, description="extra request fields (e.g. top_k)")


class JudgeConfig(LLMPoolConfig):
    """The LLM judge; the template must use ``{labeled_answer}`` and ``{pred_answer}``, may use ``{question}``."""

    judge_prompt_template: str | None = None
    unavailable_retry_s: float = Field(
        DEFAULT_UNAVAILABLE_RETRY_S, ge=0, description="how long a sampler retries a judge that cannot be reached "
        "(connection errors, timeouts, 5xx on every model) before giving the slot back unscored")

    @field_validator("judge_prompt_template")
    @classmethod
    def _has_placeholders(cls, value: str | None) -> str | None:
        if value is not None:
            missing = [p for p in REQUIRED_JUDGE_PLACEHOLDERS if p not in value]
            if missing:
                raise ValueError(f"judge_prompt_template lacks {', '.join(missing)}")
        return value


class SummarizerConfig(LLMPoolConfig):
    """The summariser; further keys (e.g. the browse tools and their purposes) are kept for its users."""

    model_config = ConfigDict(extra="allow")


class AgentConfig(BaseModel):
    """The whole agent config file."""

    model_config = ConfigDict(extra="forbid")

    scorer_agent: JudgeConfig | None = None
    browse_agent: SummarizerConfig | None = None


def load_agent_config(path: str | Path) -> AgentConfig:
    """Read and validate an agent config YAML file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise AgentConfigError(f"cannot read agent config {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise AgentConfigError(f"agent config {path} is not valid YAML: {exc}") from exc
    try:
        return AgentConfig.model_validate(data or {})
    except ValidationError as exc:
        raise AgentConfigError(f"invalid agent config {path}: {_describe_errors(exc)}") from None


def _describe_errors(exc: ValidationError) -> str:
    """Validation errors without the offending input values (they may hold secrets)."""
    errors = exc.errors(include_input=False)
    return "; ".join(f"{'.'.join(str(p) for p in error['loc']) or 'file'}: {error['msg']}" for error in errors)
