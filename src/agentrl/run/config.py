"""Every option of `agentrl run`: one field per option (the flag ``--<name>``), named after the environment variable
the example scripts map to it (``MODEL`` → ``--model``, ``LIMIT`` → ``--num_eval_tasks``, ...).

Options left unset get their defaults when the config is built, some of them from others, as the descriptions
say: with ``--env`` the rollouts are longer and hotter and the warm-up is on oracle demonstrations; with
``--lora_r`` the learning rates are 10× (RL) and 30× (warm-up) higher; with ``--model`` there is no warm-up unless
asked; ``--mode eval`` evaluates with its own defaults.

This module imports no torch, so building the command-line parser stays fast.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

REPO = Path(__file__).resolve().parents[3]
"""The repository checkout: its ``assets/`` hold the built-in task sets, its ``runs/`` the run directories."""
TASK_SETS = REPO / "assets" / "tasks"
ORACLE_ENVS = ("textcraft", "babyai")
"""Environments with an oracle: ``--env`` warms up on its demonstrations by default."""
MINIRL_FLAGS = ("--loss_calculater MINIRL --token_level_loss false --strict_in_bound true "
                "--skip_length_normalization true")


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
    run_dir: Path | None = Field(None, description="run files and logs (RUN_DIR; default: runs/RUN_NAME in the "
                                 "repository)")
    model: str | None = Field(
        None, description="Hugging Face directory to serve and train (MODEL; default: the embedded "
        "SmolLM2-135M-Instruct); with --sglang_urls the servers' model (its tokenizer)")

    # ------------------------------------------------------------------------------------- database, inference
    mongo_uri: str | None = Field(
        None, description="MongoDB server, e.g. mongodb://user:pass@h1,h2/?replicaSet=rs0; the run name becomes "
        "the database (MONGO_URI; default: an embedded NX-27017 server of the run's own, stopped at the end, its "
        "data kept)")
    db_dir: Path | None = Field(None, description="data directory of the embedded server (AGENTRL_DB_DIR; "
                                "default: RUN_DIR/db)")
    db_port: int | None = Field(None, description="port of the embedded server (AGENTRL_DB_PORT; default: the one "
                                "its data directory used last, else a free one)")
    sglang_urls: str | None = Field(
        None, description="comma-separated SGLang servers serving --model (SGLANG_URLS; default: an `agentrl "
        "engine` started here, serving the warmed-up model)")
    engine_threads: int | None = Field(
        None, ge=1, description="CPU threads of the engines started here (ENGINE_THREADS; default: the engine's, "
        "one less than the CPUs this machine gives it)")
    engine_startup_s: float = Field(600.0, gt=0, description="how long the engine may take to start "
                                    "(ENGINE_STARTUP_S)")

    # ---------------------------------------------------------------------------------- tools, environments
    mcp_config: str = Field(
        "", description="MCP servers file (MCP_CONFIG; default: the built-in calculator over stdio; none: no tools)")
    query_prompt: str | None = Field(
        None, description="user prompt template with {query} for samplers, evaluations and demonstrations "
        "(QUERY_PROMPT; default: the question alone)")
    env: str | None = Field(
        None, description="textcraft, babyai or sciworld: RL on that AgentGym environment's episodes, scored by "
        "its reward (ENV): tasks from its train split, held-out tasks from its test split (default: none)")
    env_server: str | None = Field(
        None, description="with --env: an AgentGym server URL of that environment (ENV_SERVER; default: "
        "`agentrl envs serve ENV` started here)")

    # ------------------------------------------------------------------------------------------------- tasks
    tasks: Path = Field(TASK_SETS / "arith_tools.jsonl", description="RL task file (TASKS; default: "
                        "assets/tasks/arith_tools.jsonl; with --env: its train split)")
    num_tasks: int | None = Field(
        None, ge=0, description="the first N RL tasks, 0: all (NUM_TASKS; default: 48; with --env: the whole "
        "train split)")
    rounds: int | None = Field(
        None, ge=1, description="rounds each RL task is sampled in; from the second on, the pass-rate curriculum "
        "mostly skips a task whose last group was all solved or all failed (ROUNDS; default: 3; with --env: 1)")
    scorer: str | None = Field(
        None, description="--mode rl: scorer of every RL task, empty: the tasks' own (SCORER; default: math, 1 "
        "for a right answer, with a warm-up; without one math_format, which also gives 0.1 for a wrong answer in "
        "the answer schema; with --env: empty, the environment's reward); --mode eval: scorer of the tasks that "
        "name none (default: math)")
    answer_schema: str = Field("boxed", description="answer marker of tasks that name none, in evaluations and "
                               "warm-up demonstrations (ANSWER_SCHEMA)")
    num_generations: int = Field(4, ge=1, description="samples per RL task, the group size (NUM_GENERATIONS)")

    # ------------------------------------------------------------------------------------------ evaluations
    eval_tasks: Path | None = Field(
        None, description="held-out tasks, scored greedily (seed --eval_seed) with the starting, warmed-up and "
        "final model (EVAL_TASKS; default: assets/tasks/arith_heldout.jsonl; --mode eval: the tasks to evaluate, "
        "TASKS, default assets/tasks/arith_tools.jsonl; with --env: its test split)")
    num_eval_tasks: int | None = Field(
        None, ge=0, description="the first N of them (NUM_EVAL_TASKS; default: 32, 0: no evaluation; --mode eval: "
        "LIMIT, default 8, 0: all)")
    eval_samples_per_task: int = Field(2, ge=1, description="--mode eval: samples per task, k of pass@k and avg@k "
                                       "(K)")
    eval_repeats: int = Field(1, ge=1, description="--mode eval: repeat the k samples R times (REPEATS)")
    eval_seed: int = Field(0, description="sampling seed of the evaluations (SEED)")
    force: bool = Field(False, description="--mode eval: recompute a stored result (FORCE=1); the held-out "
                        "evaluations of --mode rl always do")
    agent_config: Path | None = Field(None, description="--mode eval: agent config YAML with the LLM judge, for "
                                      "tasks scored by agentcpm (AGENT_CONFIG)")
    extra_eval_flags: str = Field("", description="more `agentrl eval` flags, for every evaluation "
                                  "(EXTRA_EVAL_FLAGS; default: none)")

    # --------------------------------------------------------------------------------------------- warm-up
    warmup: int | None = Field(
        None, ge=0, description="demonstrations to fine-tune on (SFT, CrossEntropy) before RL, 0: no warm-up "
        "(WARMUP; default: 24 with the embedded model, 0 with --model; with --env: 64 oracle demonstrations for "
        "textcraft and babyai, 0 otherwise)")
    warmup_tasks: Path = Field(TASK_SETS / "arith_warmup.jsonl", description="tasks the demonstrations are made "
                               "of with the real tools (WARMUP_TASKS; default: assets/tasks/arith_warmup.jsonl)")
    warmup_epochs: int | None = Field(None, ge=1, description="epochs of the warm-up (WARMUP_EPOCHS; default: 1; "
                                      "with --env: 2)")
    warmup_learning_rate: float | None = Field(
        None, gt=0, description="learning rate of the warm-up (WARMUP_LEARNING_RATE; default: 1e-4, 3e-3 with "
        "--lora_r; with --env: 2e-4, 2e-3 with --lora_r)")
    warmup_threads: int = Field(2, ge=1, description="CPU threads of the warm-up trainer (WARMUP_THREADS)")

    # ------------------------------------------------------------------------------------ rollouts, samplers
    num_samplers: int = Field(1, ge=1, description="sampler processes (NUM_SAMPLERS)")
    samples_per_sampler: int = Field(16, ge=1, description="trajectories in flight per sampler, and in the "
                                     "evaluation of --mode eval (SAMPLES_PER_SAMPLER; CONCURRENCY)")
    max_turns: int | None = Field(None, ge=1, description="LLM calls per trajectory, also in the evaluations "
                                  "(MAX_TURNS; default: 2; with --env: 12)")
    max_new_tokens: int | None = Field(None, ge=1, description="tokens per LLM call, also in the evaluations "
                                       "(MAX_NEW_TOKENS; default: 48; --mode eval: 128)")
    temperature: float | None = Field(
        None, ge=0, description="sampling temperature of the samplers and the trainer (TEMPERATURE; default: 0.7; "
        "with --env: 1.0); --mode eval: of the evaluation (default: 0.7)")
    extra_sample_flags: str = Field("", description="more `agentrl sample` flags (EXTRA_SAMPLE_FLAGS; default: none)")

    # ----------------------------------------------------------------------------------------------- trainer
    loss_name: str = Field("MINIRL", description="name of the loss in the status line and the logs")
    loss_flags: str = Field(MINIRL_FLAGS, description=f"trainer flags of the loss (default: {MINIRL_FLAGS})")
    train_steps: int = Field(32, ge=1, description="at most this many optimiser steps; the run also ends when "
                             "every task is sampled and trained (TRAIN_STEPS)")
    train_time_s: float | None = Field(None, gt=0, description="stop training after the step that passes this "
                                       "many seconds (TRAIN_TIME_S; default: no limit)")
    train_batch_size: int = Field(4, ge=1, description="samples per optimiser step (TRAIN_BATCH_SIZE)")
    learning_rate: float | None = Field(None, gt=0, description="RL learning rate (LEARNING_RATE; default: 2e-6; "
                                        "5e-5 with --lora_r)")
    max_staleness: int = Field(2, ge=0, description="policy versions a sample may lag behind; admission control "
                               "lets (MAX_STALENESS + 1) × TRAIN_BATCH_SIZE trajectories be sampled ahead, so 2 keeps "
                               "the engine batching while the trainer steps and publishes (MAX_STALENESS)")
    sync_every: int = Field(2, ge=1, description="publish the weights to the engines every N steps: each publish "
                            "stops a CPU engine for its load and the policy probe, and samples stay fresh in "
                            "versions (SYNC_EVERY)")
    save_steps: int = Field(8, ge=0, description="checkpoint every N steps (SAVE_STEPS)")
    save_total_limit: int = Field(1, ge=1, description="checkpoints kept, newest first: resuming needs the last one "
                                  "only, and each holds the weights and optimizer state (SAVE_TOTAL_LIMIT)")
    lora_r: int = Field(
        0, ge=0, description="LoRA rank: adapters on every linear layer (alpha 32, no dropout) in the warm-up and "
        "RL, at 10× the RL and 30× the warm-up learning rate; 0: full fine-tuning (LORA_R)")
    lora_publish: Literal["merged", "adapter"] = Field(
        "merged", description="with --lora_r: what RL publishes to the inference services, full weights or the "
        "adapter alone (the engine started here gets --enable_lora; SGLang servers need --enable-lora "
        "--max-lora-rank R --lora-target-modules all) (LORA_PUBLISH)")
    accelerate_config: Path | None = Field(None, description="launch the trainer with `accelerate launch "
                                           "--config_file` this file, e.g. assets/accelerate/fsdp2.yml "
                                           "(ACCELERATE_CONFIG; default: one process)")
    nproc: int = Field(1, ge=1, description="trainer processes with torchrun on CPU (gloo), without "
                       "--accelerate_config (NPROC)")
    trainer_threads: int = Field(1, ge=1, description="CPU threads per trainer process (TRAINER_THREADS)")
    output_dir: Path | None = Field(None, description="checkpoints, published weights and the final model "
                                    "(OUTPUT_DIR; default: RUN_DIR/output)")
    extra_train_flags: str = Field("", description="more trainer flags, after the others (EXTRA_TRAIN_FLAGS; "
                                   "default: none)")

    @model_validator(mode="after")
    def _fill_defaults(self) -> RunConfig:
        """The defaults that depend on other options (see the field descriptions)."""
        if self.lora_publish == "adapter" and not self.lora_r:
            raise ValueError("--lora_publish adapter needs --lora_r")
        for name in ("loss_flags", "extra_train_flags", "extra_sample_flags", "extra_eval_flags"):
            try:
                shlex.split(getattr(self, name))
            except ValueError as error:
                raise ValueError(f"--{name}: {error}") from None
        evaluating, lora = self.mode == "eval", self.lora_r > 0
        self.run_name = self.run_name or time.strftime(f"{'eval' if evaluating else self.loss_name.lower()}"
                                                       "-%Y%m%d-%H%M%S")
        self.run_dir = self.run_dir or REPO / "runs" / self.run_name
        self.output_dir = self.output_dir or self.run_dir / "output"
        self.eval_tasks = self.eval_tasks or TASK_SETS / ("arith_tools.jsonl" if evaluating else "arith_heldout.jsonl")
        self.num_eval_tasks = (8 if evaluating else 32) if self.num_eval_tasks is None else self.num_eval_tasks
        self.max_new_tokens = self.max_new_tokens or (128 if evaluating else 48)
        self.learning_rate = self.learning_rate or (5e-5 if lora else 2e-6)
        if evaluating:
            self.scorer = self.scorer or "math"
        if self.env and not evaluating:
            self.scorer = self.scorer or ""
            self.warmup = (64 if self.env in ORACLE_ENVS else 0) if self.warmup is None else self.warmup
            self.warmup_epochs = self.warmup_epochs or 2
            self.warmup_learning_rate = self.warmup_learning_rate or (2e-3 if lora else 2e-4)
            self.temperature = 1.0 if self.temperature is None else self.temperature
        self.num_tasks = 48 if self.num_tasks is None and not self.env else self.num_tasks
        self.rounds = self.rounds or (1 if self.env else 3)
        self.max_turns = self.max_turns or (12 if self.env else 2)
        self.temperature = 0.7 if self.temperature is None else self.temperature
        self.warmup = (0 if self.model else 24) if self.warmup is None else self.warmup
        # Format credit is shaping for a model that cannot be right yet; after a warm-up it makes groups of wrong
        # answers teach (a wrong answer beats none), and RL then reinforced wrong expressions (docs/benchmarks.md).
        self.scorer = ("math" if self.warmup else "math_format") if self.scorer is None else self.scorer
        self.warmup_epochs = self.warmup_epochs or 1
        self.warmup_learning_rate = self.warmup_learning_rate or (3e-3 if lora else 1e-4)
        return self
