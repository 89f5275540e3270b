"""Configuration of a sampler process (``agentrl sample``) and of the rollouts it shares with ``agentrl eval``.

The rollout options (:class:`RolloutConfig`: sampling, turn and token limits, prompt, tool-call parser, tool
timeout), the tools and scorers (:class:`ToolsConfig`) and the concurrency (:class:`ConcurrencyConfig`) are declared
once here, each with its description; ``SamplerConfig`` and ``agentrl eval``'s ``EvalConfig`` hold them as nested
models, and both commands' flags are generated from them (:mod:`agentrl.config_flags`). Flag names follow the
original AgentRL's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentrl.config_flags import NO_FLAG, Flag, comma_list
from agentrl.rollout.curriculum import CurriculumConfig
from agentrl.store.connection import DB_HELP
from agentrl.store.models import RUN_VALUE_HELP, RunValues
from agentrl.trajectory.advantages import AdvantageConfig

# The sampling parameters ``--preferred_sampling_params`` may set (each also has its own flag).
PREFERRED_KEYS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")
PENALTY_HELP = ("logprobs returned by the engine then come from the penalised distribution while the trainer's "
                "assume the policy's own, which biases the importance ratio (refused on the train split unless "
                "--allow_biased_sampling)")


class SamplingFlagsError(ValueError):
    """``--preferred_sampling_params`` names an unknown parameter, a value that is not a number, or contradicts a
    flag."""


def resolve_sampling(explicit: dict[str, Any], preferred: dict[str, Any]) -> dict[str, float | int]:
    """The sampling values given by a flag (``explicit``) or by ``--preferred_sampling_params`` (``preferred``),
    the flag first; those given by neither are left out (their defaults apply). An explicit flag that disagrees
    with the preferred value is an error naming both."""
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
        if (value := flag if flag is not None else wanted) is not None:
            resolved[key] = value
    return resolved


class RolloutConfig(BaseModel):
    """How one trajectory is rolled out: sampling, turn and token limits, prompt, tool calls (``agentrl sample``;
    ``agentrl eval`` uses :class:`agentrl.eval.runner.EvalRolloutConfig`, greedy and seeded by default). Every
    sampling parameter is sent with every request, so a server's own defaults never apply."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(8, ge=1, description="LLM calls per trajectory at most")
    max_new_tokens: int = Field(512, ge=1, description="tokens generated per LLM call")
    max_prompt_tokens: int = Field(4096, ge=1, description="context limit of a prompt")
    temperature: float = Field(RunValues.model_fields["temperature"].default, ge=0.0,
                               description=f"sampling temperature, 0: greedy; on the train split {RUN_VALUE_HELP}")
    top_p: float = Field(1.0, description="nucleus sampling: the smallest token set of this probability")
    top_k: int = Field(-1, description="sample among the k most likely tokens; -1: no top-k limit")
    min_p: float = Field(0.0, description="drop tokens less likely than this fraction of the most likely one")
    presence_penalty: float = Field(
        0.0, description="subtract this from the logit of every token already generated; " + PENALTY_HELP)
    frequency_penalty: float = Field(
        0.0, description="subtract this per earlier occurrence of a generated token; " + PENALTY_HELP)
    preferred_sampling_params: dict[str, Any] | None = Field(
        None, description="JSON object of values of " + ", ".join(PREFERRED_KEYS) + " for the flags not given; a "
        "flag that disagrees is an error (default: none)")
    seed: int | None = Field(None, description="seed of the engine's sampling (reproducible runs)")
    query_prompt: str = Field("{query}", description="user prompt template with {query}")
    new_context: Literal["disabled", "discard_all_tools", "discard_all"] = Field(
        "disabled", description="what to do when the context outgrows --max_prompt_tokens")
    repetition_early_stop_times: int = Field(
        0, ge=0, description="end a trajectory whose output repeats this many times (0: never)")
    tool_call_parser: str = Field("qwen", description="qwen | hermes | openai | minicpm")
    tool_timeout: float = Field(60.0, gt=0.0, description="seconds per tool call")

    @model_validator(mode="before")
    @classmethod
    def _apply_preferred(cls, data: Any) -> Any:
        """Fill the sampling values not given from ``preferred_sampling_params`` (a contradiction is an error)."""
        if not isinstance(data, dict) or not isinstance(data.get("preferred_sampling_params"), dict):
            return data
        return {**data, **resolve_sampling(data, data["preferred_sampling_params"])}

    def sampling_params(self) -> dict[str, Any]:
        """The ``sampling_params`` of every LLM call (all sent: a server's preferred defaults never apply)."""
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "min_p": self.min_p, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "repetition_penalty": 1.0}


class ToolsConfig(BaseModel):
    """The tools (MCP servers, AgentGym environments), the LLM judge and the scorers of the rollouts."""

    model_config = ConfigDict(extra="forbid")

    mcp_config: str | None = Field(None, description="JSON/YAML file listing MCP servers (stdio command or URL)")
    mcp_manager_url: str | None = Field(
        None, description="HTTP aggregator, e.g. http://localhost:8000/mcpapi")
    mcp_server_name: str | None = Field(None, description="only these servers (comma-separated)")
    mcp_auth_token: str | None = Field(None, description="bearer token of the aggregator")
    agent_config_path: str | None = Field(
        None, description="YAML with the LLM judge (scorer_agent) and summariser (browse_agent) endpoints")
    scorer_module: Annotated[list[str], Flag(repeat=True, metavar="FILE.py")] = Field(
        default_factory=list, description="Python file registering scorers with "
        "MCPScorerFactory.register_scorer (repeatable)")
    env_server: Annotated[list[str], Flag(repeat=True, metavar="NAME=URL")] = Field(
        default_factory=list, description="AgentGym environment server of environment NAME (ours: `agentrl envs "
        "serve NAME`, or AgentGym's own), repeatable; a built-in environment without one gets a local server")


class ConcurrencyConfig(BaseModel):
    """How many rollouts run at once and how long requests and leases last."""

    model_config = ConfigDict(extra="forbid")

    max_concurrent_samples_per_process: int = Field(8, ge=1, description="trajectories in flight in this process")
    target_concurrency: int = Field(32, ge=1, description="max in-flight requests per service")
    request_timeout: float = Field(600.0, gt=0.0, description="seconds per inference or environment request")
    lease_s: float = Field(60.0, gt=0.0, description="lease duration; heartbeats every third of it")


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
    seed: Annotated[int, NO_FLAG] = Field(
        0, description="seed of the random choices (balancing, context-error reservation)")


class SamplerConfig(BaseModel):
    """Everything a sampler process needs besides the database; each field (and each field of a nested model) is
    a flag of ``agentrl sample``."""

    model_config = ConfigDict(extra="forbid")

    db_connection_string: Annotated[str | None, Flag(metavar="URI")] = Field(None, description=DB_HELP)
    model_name_or_path: str | None = Field(
        None, description="tokenizer and chat template of the policy (default: the embedded SmolLM2 model)")
    split: str = Field("train", description="split whose Tasks are sampled")
    sampler_id: str | None = Field(None, description="lease owner name (default: host:pid:random)")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, title="rollout")
    tools: ToolsConfig = Field(default_factory=ToolsConfig, title="tools and scorers")
    concurrency: ConcurrencyConfig = Field(default_factory=ConcurrencyConfig,
                                           title="concurrency and admission control")
    inference_urls: Annotated[list[str], Flag(parse=comma_list, unparse=",".join, metavar="URLS")] = Field(
        default_factory=list, description="comma-separated SGLang URLs to register and health-check (engines "
        "register themselves)")
    max_staleness: int | None = Field(
        RunValues.model_fields["max_staleness"].default, ge=0,
        description="admission control (train split): start a new group only while the slots of the groups being "
        "sampled plus the ready, untrained samples fit (max_staleness + 1) × train_batch_size (none: no bound); "
        f"{RUN_VALUE_HELP}")
    train_batch_size: int = Field(RunValues.model_fields["train_batch_size"].default, ge=1,
                                  description=f"samples per trainer step (admission control); {RUN_VALUE_HELP}")
    exit_when_done: bool = Field(False, description="exit once the split has no open Task left")
    max_consecutive_failures: Annotated[int | None, Flag(metavar="N")] = Field(
        None, ge=0, description="exit with an error after N trajectories in a row failed for infrastructure "
        "(inference, environment, judge or database unavailable, aborted generation, environment error); "
        "default: 4 × --max_concurrent_samples_per_process; 0: never")
    curriculum: CurriculumConfig = Field(default_factory=CurriculumConfig,
                                         title="rounds and curriculum (train split)")
    group: GroupConfig = Field(default_factory=GroupConfig, title="group stage")
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, title="advantages")

    allow_biased_sampling: bool = Field(
        False, description="train split: allow --top_p < 1, --top_k, --min_p and penalties, whose tokens come from "
        "another distribution than the logprobs the engine reports (SGLang's convention: before truncation, after "
        "penalties), so the trainer's importance ratio is biased (default: refused)")

    @model_validator(mode="after")
    def _unbiased_behaviour_logprobs(self) -> SamplerConfig:
        """On the train split, refuse sampling settings whose behaviour logprobs are not the sampled distribution's
        (unless ``allow_biased_sampling``)."""
        if self.split != "train" or self.allow_biased_sampling:
            return self
        r = self.rollout
        biased = [f"--{name} {value:g}" for name, value, neutral in (
            ("top_p", r.top_p, r.top_p >= 1.0), ("top_k", r.top_k, r.top_k <= 0), ("min_p", r.min_p, r.min_p <= 0.0),
            ("presence_penalty", r.presence_penalty, r.presence_penalty == 0.0),
            ("frequency_penalty", r.frequency_penalty, r.frequency_penalty == 0.0)) if not neutral]
        if biased and r.temperature > 0:
            raise ValueError(f"{', '.join(biased)} on the train split: the engine reports each token's logprob "
                             "before top-p/top-k/min-p truncation and after penalties (SGLang's convention), not "
                             "under the distribution it was sampled from, so the trainer's importance ratio would be "
                             "biased. Sample RL data with the defaults (--top_p 1 --top_k -1 --min_p 0, no "
                             "penalties), or pass --allow_biased_sampling true to accept the bias")
        return self

    @model_validator(mode="after")
    def _curriculum_seed(self) -> SamplerConfig:
        """The curriculum's revisit draws are seeded by ``--seed`` unless set otherwise."""
        if "seed" not in self.curriculum.model_fields_set:
            self.curriculum = self.curriculum.model_copy(update={"seed": self.rollout.seed or 0})
        return self

    def run_values(self) -> dict[str, Any]:
        """The values of :class:`RunValues` this sampler was given (the others come from the run)."""
        given = {name: getattr(self, name) for name in ("train_batch_size", "max_staleness")
                 if name in self.model_fields_set}
        if "temperature" in self.rollout.model_fields_set:
            given["temperature"] = self.rollout.temperature
        return given

    def run_value_sources(self) -> dict[str, str]:
        """How this sampler was given each of :meth:`run_values` (for the run's record and its errors)."""
        return {key: f"a sampler's --{key} {value:g}" if isinstance(value, float) else f"a sampler's --{key} {value}"
                for key, value in self.run_values().items()}

    def with_run_values(self, values: dict[str, Any]) -> SamplerConfig:
        """This configuration with the values the run records (``Run.values``: only those some process was given)
        in place of the ones this sampler was not given; its own given values equal the run's (``Runs.agree``)."""
        values = {key: value for key, value in values.items() if key not in self.run_values()}
        update = {key: value for key, value in values.items() if key != "temperature"}
        if "temperature" in values:
            update["rollout"] = self.rollout.model_copy(update={"temperature": values["temperature"]})
        return self.model_copy(update=update)

    @property
    def failure_limit(self) -> int:
        """``max_consecutive_failures`` resolved (0: never stop). By default four times the concurrency: one outage
        fails every trajectory in flight at once, so only four such waves in a row without a success stop it."""
        if self.max_consecutive_failures is None:
            return 4 * self.concurrency.max_concurrent_samples_per_process
        return self.max_consecutive_failures
