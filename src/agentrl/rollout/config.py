"""Configuration of a sampler process (``agentrl sample``); flag names follow the original's."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentrl.rollout.curriculum import CurriculumConfig
from agentrl.trajectory.advantages import AdvantageConfig

# The sampling parameters ``--preferred_sampling_params`` may set (each also has its own flag).
PREFERRED_KEYS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")
# The original AgentRL's default ``--preferred_sampling_params`` (plus no penalties): what a training sampler uses.
SAMPLER_SAMPLING_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


class SamplingFlagsError(ValueError):
    """``--preferred_sampling_params`` is not valid JSON, names an unknown parameter, or contradicts a flag."""


def resolve_sampling(explicit: dict[str, float | int | None], preferred_json: str | None,
                     defaults: dict[str, float | int]) -> dict[str, float | int]:
    """The sampling values of ``PREFERRED_KEYS``: each explicit flag, else its ``--preferred_sampling_params``
    value, else ``defaults``. An explicit flag that disagrees with the preferred value is an error naming both."""
    preferred: dict[str, Any] = {}
    if preferred_json is not None:
        try:
            preferred = json.loads(preferred_json)
        except json.JSONDecodeError as error:
            raise SamplingFlagsError(f"--preferred_sampling_params is not valid JSON: {error}") from error
        if not isinstance(preferred, dict):
            raise SamplingFlagsError(f"--preferred_sampling_params must be a JSON object, got {preferred_json!r}")
        unknown = sorted(set(preferred) - set(PREFERRED_KEYS))
        if unknown:
            raise SamplingFlagsError(f"--preferred_sampling_params: unsupported key(s) {', '.join(unknown)} "
                                     f"(accepted: {', '.join(PREFERRED_KEYS)})")
        not_numbers = sorted(k for k, v in preferred.items() if isinstance(v, bool) or not isinstance(v, int | float))
        if not_numbers:
            raise SamplingFlagsError(f"--preferred_sampling_params: {', '.join(not_numbers)} must be a number")
    resolved: dict[str, float | int] = {}
    for key in PREFERRED_KEYS:
        flag, wanted = explicit.get(key), preferred.get(key)
        if flag is not None and wanted is not None and float(flag) != float(wanted):
            raise SamplingFlagsError(f"--{key} {flag} disagrees with --preferred_sampling_params {key}={wanted}: "
                                     "give one of them")
        resolved[key] = next(v for v in (flag, wanted, defaults[key]) if v is not None)
    return resolved


class GroupConfig(BaseModel):
    """Group stage, run once per Task when all its samples are scored: which samples are trained."""

    model_config = ConfigDict(extra="forbid")

    zero_variance_threshold: float = Field(
        0.1, description="drop a group whose rewards span less than this (no learning signal)")
    balance_sample: bool = Field(False, description="keep at most min(#right,#wrong)+1/+2 wrong/right samples")
    min_turns: int = Field(0, description="drop correct samples with at most this many turns (anti-shortcut)")
    efficient_rewarding: bool = Field(
        False, description="shift rewards by turn-count rank: shorter right and longer wrong samples gain")
    reserve_context_error_count: int = Field(
        -1, description="keep at most this many length/turns-limit samples per group (-1: keep all)")
    seed: int = Field(0, description="seed of the random choices (balancing, context-error reservation)")


class SamplerConfig(BaseModel):
    """Everything a sampler process needs besides the database."""

    model_config = ConfigDict(extra="forbid")

    db_connection_string: str | None = None
    model_name_or_path: str | None = Field(None, description="tokenizer and chat template (default: embedded)")
    split: str = "train"
    sampler_id: str | None = None
    # rollout
    max_turns: int = 8
    max_new_tokens: int = 512
    max_prompt_tokens: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = Field(0.0, description="!= 0 biases the trainer's importance ratio")
    frequency_penalty: float = Field(0.0, description="!= 0 biases the trainer's importance ratio")
    seed: int | None = None
    query_prompt: str = "{query}"
    new_context: Literal["disabled", "discard_all_tools", "discard_all"] = "disabled"
    repetition_early_stop_times: int = 0
    tool_call_parser: str = "qwen"
    tool_timeout: float = 60.0
    # tools and scorers
    mcp_config: str | None = None
    mcp_manager_url: str | None = None
    mcp_server_name: str | None = None
    mcp_auth_token: str | None = None
    agent_config_path: str | None = None
    scorer_module: list[str] = Field(default_factory=list)
    env_server: list[str] = Field(default_factory=list, description="NAME=URL of AgentGym environment servers; "
                                  "built-in environments without one get a local server")
    # concurrency, leases, admission control
    max_concurrent_samples_per_process: int = 8
    target_concurrency: int = 32
    inference_urls: list[str] = Field(default_factory=list)
    request_timeout: float = 600.0
    lease_s: float = 60.0
    max_staleness: int = 1
    train_batch_size: int = 16
    exit_when_done: bool = False
    max_consecutive_failures: int | None = Field(
        None, ge=0, description="stop (exit non-zero) after this many trajectories in a row failed for "
                                "infrastructure; None: 4 × max_concurrent_samples_per_process; 0: never")
    group: GroupConfig = Field(default_factory=GroupConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig)

    def sampling_params(self) -> dict[str, Any]:
        """The ``sampling_params`` of every LLM call (all sent: a server's preferred defaults never apply)."""
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "min_p": self.min_p, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "repetition_penalty": 1.0}

    @property
    def failure_limit(self) -> int:
        """``max_consecutive_failures`` resolved (0: never stop). By default four times the concurrency: one outage
        fails every trajectory in flight at once, so only four such waves in a row without a success stop it."""
        if self.max_consecutive_failures is None:
            return 4 * self.max_concurrent_samples_per_process
        return self.max_consecutive_failures

    @property
    def penalised(self) -> bool:
        """Penalties change the sampling distribution away from the policy's, which the trainer assumes."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
