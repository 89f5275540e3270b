"""Configuration of a sampler process (``agentrl sample``); flag names follow the original's."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from agentrl.training.advantages import AdvantageConfig


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
    # concurrency, leases, admission control
    max_concurrent_samples_per_process: int = 8
    target_concurrency: int = 32
    inference_urls: list[str] = Field(default_factory=list)
    request_timeout: float = 600.0
    lease_s: float = 60.0
    max_staleness: int = 1
    train_batch_size: int = 16
    exit_when_done: bool = False
    group: GroupConfig = Field(default_factory=GroupConfig)
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
