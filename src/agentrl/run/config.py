"""Every option of `agentrl run`, as one tree: the run's own options, the values several processes share, and one
section per process the run starts, each that process's own configuration model.

- **Run options** (``--env``, ``--num_eval_tasks``, ``--warmup``, ...): what to start and on what. Each flag's
  environment variable in the example scripts is its name in upper case (``MODEL`` → ``--model``).
- **Shared values** (:data:`SHARED`): set once here and pushed down to every section that needs them, so the
  samplers and the trainer cannot disagree (``--temperature``, ``--train_batch_size``, ``--max_turns``, ...). Left
  unset, a shared value is its first section's default, declared on that component.
- **Sections** — ``sampler`` (`agentrl sample`'s :class:`SamplerConfig`), ``trainer`` (:class:`TrainConfig`),
  ``warmup_trainer`` (the warm-up's :class:`TrainConfig`), ``eval`` (`agentrl eval`'s :class:`EvalConfig`, every
  evaluation of the run), ``engine`` (`agentrl engine`'s :class:`EngineCommandConfig`: the engines the run and
  its evaluations start): any flag of that command as ``--SECTION.FLAG`` (``--trainer.weight_decay 0.1``), a key of
  a ``[SECTION]`` table in a file, or a short name of :data:`SHORT_NAMES` (``--learning_rate`` is
  ``--trainer.learning_rate``). The run starts each process with the flags of its section, the shared values and
  what the run itself wires in (:data:`WIRED`: database, inference URLs, model, tools, output), generated from the
  models (:func:`agentrl.config_flags.to_argv`): no flag is listed or renamed by hand.

Every option has one default, declared on its component; the CPU demo's choices (short turns, small batches, the
learning rate that suits the embedded model) are the preset ``configs/cpu-demo.toml`` that the example scripts name
(``--preset cpu-demo``), with its ``--env``, LoRA and own-model variants as tables of that file
(:mod:`agentrl.config_files`). Only what depends on other options is derived in code: the run name and
directories, the held-out task set, and the RL tasks' scorer.

This module imports no torch, so building the command-line parser stays fast.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agentrl.config_flags import NO_FLAG, describe_errors, flag_fields, flag_values, given_flags
from agentrl.eval.runner import EvalConfig
from agentrl.inference.engine_config import EngineCommandConfig
from agentrl.rollout.config import SamplerConfig
from agentrl.training.config import TrainConfig

REPO = Path(__file__).resolve().parents[3]
"""The repository checkout: its ``assets/`` hold the built-in task sets, ``configs/`` the presets, ``runs/`` the run
directories."""
TASK_SETS = REPO / "assets" / "tasks"
PRESETS = REPO / "configs"
MINIRL_FLAGS = ("--loss_calculater MINIRL --token_level_loss false --strict_in_bound true "
                "--skip_length_normalization true")

SECTIONS: dict[str, type[BaseModel]] = {"sampler": SamplerConfig, "trainer": TrainConfig,
                                        "warmup_trainer": TrainConfig, "eval": EvalConfig,
                                        "engine": EngineCommandConfig}
"""Section → the configuration model of the process it configures (its flags are the section's keys)."""

SHARED: dict[str, dict[str, tuple[tuple[str, str], ...]]] = {
    "rl": {"temperature": (("sampler", "temperature"), ("trainer", "temperature")),
           "train_batch_size": (("sampler", "train_batch_size"), ("trainer", "train_batch_size")),
           "max_staleness": (("sampler", "max_staleness"), ("trainer", "max_staleness")),
           "max_turns": (("sampler", "max_turns"), ("eval", "max_turns")),
           "max_new_tokens": (("sampler", "max_new_tokens"), ("eval", "max_new_tokens")),
           "query_prompt": (("sampler", "query_prompt"), ("eval", "query_prompt")),
           "samples_per_sampler": (("sampler", "max_concurrent_samples_per_process"),),
           "answer_schema": (("eval", "answer_schema"),)},
    "eval": {"temperature": (("eval", "temperature"),),
             "max_turns": (("eval", "max_turns"),),
             "max_new_tokens": (("eval", "max_new_tokens"),),
             "query_prompt": (("eval", "query_prompt"),),
             "samples_per_sampler": (("eval", "max_concurrent_samples_per_process"),),
             "answer_schema": (("eval", "answer_schema"),)},
}
"""Per mode, each shared value and the (section, flag) pairs it is pushed to; the first one's default is its own."""

SHORT_NAMES: dict[str, tuple[str, str]] = {
    "rounds": ("sampler", "rounds"),
    "learning_rate": ("trainer", "learning_rate"),
    "train_steps": ("trainer", "max_steps"),
    "train_time_s": ("trainer", "max_train_time_s"),
    "sync_every": ("trainer", "sync_every"),
    "save_steps": ("trainer", "save_steps"),
    "save_total_limit": ("trainer", "save_total_limit"),
    "trainer_threads": ("trainer", "num_threads"),
    "warmup_epochs": ("warmup_trainer", "num_train_epochs"),
    "warmup_learning_rate": ("warmup_trainer", "learning_rate"),
    "warmup_threads": ("warmup_trainer", "num_threads"),
    "eval_samples_per_task": ("eval", "num_samples_per_task"),
    "eval_repeats": ("eval", "repeats"),
    "eval_seed": ("eval", "seed"),
    "force": ("eval", "force"),
    "agent_config": ("eval", "agent_config_path"),
    "engine_threads": ("engine", "num_threads"),
}
"""The example scripts' names of section flags (``LEARNING_RATE`` → ``--learning_rate`` → ``trainer.learning_rate``)."""

WIRED: dict[str, frozenset[str]] = {
    "sampler": frozenset({"db_connection_string", "model_name_or_path", "inference_urls", "mcp_config",
                          "env_server", "split"}),
    "trainer": frozenset({"db_connection_string", "run_name", "model_name_or_path", "output_dir", "split",
                          "use_peft", "lora_r", "lora_alpha", "lora_target_modules", "lora_dropout", "lora_publish"}),
    "warmup_trainer": frozenset({"db_connection_string", "run_name", "model_name_or_path", "output_dir", "split",
                                 "use_peft", "lora_r", "lora_alpha", "lora_target_modules", "lora_dropout",
                                 "lora_publish", "loss_calculater", "enable_sampling", "save_steps"}),
    "eval": frozenset({"db_connection_string", "model_name_or_path", "inference_urls", "mcp_config", "env_server",
                       "tasks", "split", "limit", "name", "engine_args", "scorer"}),
    "engine": frozenset({"model_name_or_path", "port", "db_connection_string", "enable_lora", "no_register",
                         "api_key"}),  # a key goes by $AGENTRL_INFERENCE_API_KEY, never on a command line
}
"""Per section, the flags the run sets itself from its options and what it started (a section may not set them)."""


def _shared(mode: str, name: str) -> Any:
    """The default of shared value ``name``: that of its first section's flag."""
    section, flag = SHARED[mode][name][0]
    return flag_fields(SECTIONS[section])[flag].get_default(call_default_factory=True)


class RunConfig(BaseModel):
    """A whole run: database, inference, tools or environment, tasks, evaluations, warm-up, samplers, trainer."""

    model_config = ConfigDict(extra="forbid")

    # ------------------------------------------------------------------------------------------------- the run
    mode: Literal["rl", "eval"] = Field(
        "rl", description="rl: held-out evaluation, warm-up, RL and the summary (minirl_example.sh, "
        "grpo_example.sh); eval: one `agentrl eval` of --model on --eval_tasks (eval_example.sh)")
    run_name: str | None = Field(
        None, description="database and run directory name (default: LOSS_NAME-YYYYmmdd-HHMMSS in lower case; "
        "--mode eval: eval-YYYYmmdd-HHMMSS)")
    run_dir: Path | None = Field(None, description="run files and logs (default: runs/RUN_NAME in the repository)")
    model: str | None = Field(
        None, description="Hugging Face directory to serve and train (default: the embedded SmolLM2-135M-Instruct; "
        "embedded-vision: it with a random vision tower of its own, a Qwen2.5-VL built once, as the picture demo "
        "uses); with --sglang_urls the servers' model (its tokenizer)")

    # ------------------------------------------------------------------------------------- database, inference
    mongo_uri: str | None = Field(
        None, description="MongoDB server, e.g. mongodb://user:pass@h1,h2/?replicaSet=rs0; the run name becomes "
        "the database (default: an embedded NX-27017 server of the run's own, stopped at the end, its data kept)")
    db_dir: Path | None = Field(None, description="data directory of the embedded server (AGENTRL_DB_DIR; "
                                "default: RUN_DIR/db)")
    db_port: int | None = Field(None, description="port of the embedded server (AGENTRL_DB_PORT; default: the one "
                                "its data directory used last, else a free one)")
    sglang_urls: str | None = Field(
        None, description="comma-separated SGLang servers serving --model (default: an `agentrl engine` started "
        "here, serving the warmed-up model)")
    engine_startup_s: float = Field(600.0, gt=0, description="how long the engine may take to start")

    # ---------------------------------------------------------------------------------- tools, environments
    mcp_config: str = Field(
        "", description="MCP servers file (default: the built-in calculator over stdio; none: no tools)")
    env: str | None = Field(
        None, description="textcraft, babyai or sciworld: RL on that AgentGym environment's episodes, scored by "
        "its reward: tasks from its train split, held-out tasks from its test split (default: none)")
    env_server: str | None = Field(
        None, description="with --env: an AgentGym server URL of that environment (default: `agentrl envs serve "
        "ENV` started here)")

    # ------------------------------------------------------------------------------------------------- tasks
    tasks: Path = Field(TASK_SETS / "arith_tools.jsonl", description="RL task file (default: "
                        "assets/tasks/arith_tools.jsonl; with --env: its train split)")
    num_tasks: int = Field(0, ge=0, description="the first N RL tasks, 0: all")
    scorer: str | None = Field(
        None, description="--mode rl: scorer of every RL task, empty: the tasks' own (default: math, 1 for a right "
        "answer, after a warm-up; without one math_format, which also gives 0.1 for a wrong answer in the answer "
        "schema; with --env: empty, the environment's reward); --mode eval: scorer of the tasks that name none "
        "(default: the eval section's)")
    num_generations: int = Field(4, ge=1, description="samples per RL task, the group size")

    # ------------------------------------------------------------------------------------------ evaluations
    eval_tasks: Path | None = Field(
        None, description="held-out tasks, scored greedily with the starting, warmed-up and final model (default: "
        "assets/tasks/arith_heldout.jsonl; --mode eval: the tasks to evaluate, TASKS, default "
        "assets/tasks/arith_tools.jsonl; with --env: its test split)")
    num_eval_tasks: int = Field(0, ge=0, description="the first N of them (0: --mode rl: no evaluation; --mode "
                                "eval: all; LIMIT in eval_example.sh)")
    extra_eval_flags: str = Field("", description="more `agentrl eval` flags, after the others, for every "
                                  "evaluation (default: none)")
    val_before_train: bool = Field(True, description="--mode rl: evaluate the starting model before the warm-up "
                                   "(verl's name); false skips that evaluation, e.g. when its result is known")

    # --------------------------------------------------------------------------------------------- warm-up
    warmup: int = Field(0, ge=0, description="demonstrations to fine-tune on (SFT, CrossEntropy) before RL, 0: no "
                        "warm-up; with --env: the environment's oracle episodes")
    warmup_tasks: Path = Field(TASK_SETS / "arith_warmup.jsonl", description="tasks the demonstrations are made "
                               "of with the real tools (default: assets/tasks/arith_warmup.jsonl)")

    # ------------------------------------------------------------------------------------ samplers, trainer
    num_samplers: int = Field(1, ge=1, description="sampler processes")
    extra_sample_flags: str = Field("", description="more `agentrl sample` flags, after the others (default: none)")
    loss_name: str = Field("MINIRL", description="name of the loss in the status line and the logs")
    loss_flags: str = Field(MINIRL_FLAGS, description=f"trainer flags of the loss (default: {MINIRL_FLAGS})")
    lora_r: int = Field(
        0, ge=0, description="LoRA rank: adapters on every linear layer (alpha 32, no dropout) in the warm-up and "
        "RL; 0: full fine-tuning")
    lora_publish: Literal["merged", "adapter"] = Field(
        "merged", description="with --lora_r: what RL publishes to the inference services, full weights or the "
        "adapter alone (the engine started here gets --enable_lora; SGLang servers need --enable-lora "
        "--max-lora-rank R --lora-target-modules all)")
    accelerate_config: Path | None = Field(None, description="launch the trainer with `accelerate launch "
                                           "--config_file` this file, e.g. assets/accelerate/fsdp2.yml (default: "
                                           "one process)")
    nproc: int = Field(1, ge=1, description="trainer processes with torchrun on CPU (gloo), without "
                       "--accelerate_config")
    output_dir: Path | None = Field(None, description="checkpoints, published weights and the final model "
                                    "(default: RUN_DIR/output)")
    extra_train_flags: str = Field("", description="more trainer flags, after the others (default: none)")

    # ----------------------------------------------------------------- shared values (SHARED), default: None
    temperature: float | None = Field(None, ge=0, description="sampling temperature of the samplers, by which the "
                                      "trainer divides its logits (--mode eval: of the evaluation)")
    train_batch_size: int | None = Field(None, ge=1, description="samples per optimiser step; the samplers' "
                                         "admission control counts in these")
    max_staleness: int | None = Field(None, ge=0, description="policy versions a trained sample may lag behind; "
                                      "(MAX_STALENESS + 1) × TRAIN_BATCH_SIZE trajectories may be sampled ahead")
    max_turns: int | None = Field(None, ge=1, description="LLM calls per trajectory, also in the evaluations")
    max_new_tokens: int | None = Field(None, ge=1, description="tokens per LLM call, also in the evaluations")
    query_prompt: str | None = Field(None, description="user prompt template with {query} for samplers, "
                                     "evaluations and demonstrations")
    samples_per_sampler: int | None = Field(None, ge=1, description="trajectories in flight per sampler (--mode "
                                            "eval: in the evaluation; CONCURRENCY)")
    answer_schema: str | None = Field(None, description="answer marker of tasks that name none, in evaluations "
                                      "and warm-up demonstrations")

    # ------------------------------------------------------------------------------------------- sections
    sampler: Annotated[SamplerConfig, NO_FLAG] = Field(default_factory=SamplerConfig)
    trainer: Annotated[TrainConfig, NO_FLAG] = Field(default_factory=TrainConfig)
    warmup_trainer: Annotated[TrainConfig, NO_FLAG] = Field(default_factory=TrainConfig)
    eval: Annotated[EvalConfig, NO_FLAG] = Field(default_factory=EvalConfig)
    engine: Annotated[EngineCommandConfig, NO_FLAG] = Field(default_factory=EngineCommandConfig)

    @model_validator(mode="after")
    def _check_and_derive(self) -> RunConfig:
        """Refuse contradictions; fill the options derived from others (see the field descriptions)."""
        if self.lora_publish == "adapter" and not self.lora_r:
            raise ValueError("--lora_publish adapter needs --lora_r")
        for name in ("loss_flags", "extra_train_flags", "extra_sample_flags", "extra_eval_flags"):
            try:
                shlex.split(getattr(self, name))
            except ValueError as error:
                raise ValueError(f"--{name}: {error}") from None
        for section in SECTIONS:
            shared = {flag: name for name, targets in SHARED[self.mode].items() for at, flag in targets
                      if at == section}
            for flag in given_flags(getattr(self, section)):
                if flag in WIRED[section]:
                    raise ValueError(f"--{section}.{flag}: the run sets it (from its own options and what it starts)")
                if flag in shared:
                    raise ValueError(f"--{section}.{flag}: a value several processes share: set --{shared[flag]}")
            model = SECTIONS[section]
            try:  # the section as its process will get it: with the shared values
                model(**flag_values(model, self.flags(section)))
            except ValidationError as error:
                raise ValueError(describe_errors(model, error, lambda flag, at=section: f"--{at}.{flag}")) from None
        evaluating = self.mode == "eval"
        self.run_name = self.run_name or time.strftime(f"{'eval' if evaluating else self.loss_name.lower()}"
                                                       "-%Y%m%d-%H%M%S")
        self.run_dir = self.run_dir or REPO / "runs" / self.run_name
        self.output_dir = self.output_dir or self.run_dir / "output"
        self.eval_tasks = self.eval_tasks or TASK_SETS / ("arith_tools.jsonl" if evaluating else "arith_heldout.jsonl")
        if self.scorer is None and not evaluating:
            # Format credit is shaping for a model that cannot be right yet; after a warm-up it makes groups of wrong
            # answers teach (a wrong answer beats none), and RL then reinforced wrong expressions (docs/benchmarks.md).
            self.scorer = "" if self.env else "math" if self.warmup else "math_format"
        return self

    def value(self, name: str) -> Any:
        """Shared value ``name`` as the processes get it: given, else its first section's default."""
        given = getattr(self, name)
        return _shared(self.mode, name) if given is None else given

    def flags(self, section: str, **wired: Any) -> dict[str, Any]:
        """The flags of ``section``'s process: what the run wires in (``wired``, by flag name), the shared values
        given, and the section's own."""
        shared = {flag: getattr(self, name) for name, targets in SHARED[self.mode].items() for at, flag in targets
                  if at == section and getattr(self, name) is not None}
        return {**wired, **shared, **given_flags(getattr(self, section))}

    def section_value(self, section: str, flag: str) -> Any:
        """The value ``section``'s process gets for ``flag`` (given, shared, else the component's default)."""
        flags = self.flags(section)
        if flag in flags:
            return flags[flag]
        return flag_fields(SECTIONS[section])[flag].get_default(call_default_factory=True)
