"""The stages of `agentrl run`, each a small function of the :class:`RunState`: the database, the tools or environment,
the tasks, the inference service, the held-out evaluations, the warm-up, the samplers, the trainer with its live
status line, the summary. Each runs the same `agentrl` commands a user would (their logs in ``RUN_DIR/logs``)."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.config_flags import comma_list, given_flags, to_argv
from agentrl.eval.runner import EvalConfig
from agentrl.inference.engine_config import EngineCommandConfig
from agentrl.rollout.config import SamplerConfig
from agentrl.run.config import RunConfig
from agentrl.run.processes import Child, Processes, RunFailed, say
from agentrl.training.config import TrainConfig

AGENTRL = [sys.executable, "-m", "agentrl.cli.main"]
EMBEDDED_MODEL = "the embedded SmolLM2-135M-Instruct"
EMBEDDED_VISION = "embedded-vision"
"""``--model`` of the embedded vision-language model (:mod:`agentrl.inference.embedded_vision_model`)."""
HELD_OUT_CONCURRENCY = 64
"""Trajectories in flight in a held-out evaluation (the engine's batch limit): 64 tasks at once take 0.90x the time
of 16 at a time (CPU, embedded model); ``--eval.max_concurrent_samples_per_process`` may set another."""


@dataclass
class RunState:
    """What the stages share: the options, the processes, and what the earlier stages set up."""

    config: RunConfig
    processes: Processes
    db_base: str = ""
    db_query: str = ""
    stop_db_dir: Path | None = None
    tools: dict[str, Any] = field(default_factory=dict)
    inference_urls: str = ""
    eval_tasks: Path | None = None
    eval_results: list[str] = field(default_factory=list)
    samplers: list[Child] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    @property
    def dir(self) -> Path:
        assert self.config.run_dir is not None
        return self.config.run_dir

    @property
    def logs(self) -> Path:
        return self.dir / "logs"

    @property
    def name(self) -> str:
        assert self.config.run_name is not None
        return self.config.run_name

    def database_uri(self, name: str | None = None) -> str:
        """The URI of database ``name`` (default: the run's) on the run's server."""
        return f"{self.db_base}/{name or self.name}{self.db_query}"

    @property
    def prompt_flags(self) -> list[str]:
        return ["--query_prompt", self.config.query_prompt] if self.config.query_prompt else []


def use_model(run: RunState) -> None:
    """``--model embedded-vision``: the embedded vision-language model's directory, built on first use."""
    if run.config.model == EMBEDDED_VISION:
        from agentrl.inference.embedded_vision_model import default_vision_model_path

        say("model: the embedded SmolLM2-135M-Instruct with a random vision tower of its own (built once)")
        run.config.model = str(default_vision_model_path())
        say(f"model: {run.config.model}")


def model_flags(model: str | Path | None) -> list[str]:
    return ["--model_name_or_path", str(model)] if model else []


def model_flag(model: str | Path | None) -> dict[str, str]:
    """The flag naming ``model`` (none: the command's default, the embedded model)."""
    return {"model_name_or_path": str(model)} if model else {}


def call(run: RunState, name: str, command: list[str], failure: str) -> None:
    """Run an `agentrl` command with its output on the terminal; :class:`RunFailed` with ``failure`` if it fails."""
    if run.processes.call(name, command).status != 0:
        raise RunFailed(failure)


def use_database(run: RunState) -> None:
    """The MongoDB server of ``--mongo_uri`` (the run name becomes the database), else an embedded server of the
    run's own, started here (and stopped at the end, its data kept) unless it already runs."""
    from agentrl.store.embedded import EmbeddedDatabaseError, embedded_server

    config = run.config
    if config.mongo_uri:
        base, question, query = config.mongo_uri.partition("?")
        run.db_base, run.db_query = base.removesuffix("/"), question + query
        say(f"database: MongoDB at {run.db_base.rsplit('@', 1)[-1]} (database {run.name})")
        return
    data_dir = config.db_dir or run.dir / "db"
    port = config.db_port if config.db_port is not None else None if (data_dir / "nx-27017.port").is_file() else 0
    server = embedded_server(data_dir, port)
    if server.pid() is None:
        run.stop_db_dir = data_dir
    try:
        uri = server.start()
    except EmbeddedDatabaseError as error:
        raise RunFailed(f"the embedded database did not start: {error}") from None
    run.db_base = uri.removesuffix("/")
    say(f"database: embedded NX-27017 server {uri} (data in {data_dir}, database {run.name})")


def stop_database(run: RunState) -> None:
    """Stop the embedded server this run started (its data stays: `agentrl db start --data_dir DIR` reopens it)."""
    from agentrl.store.embedded import embedded_server

    if run.stop_db_dir is not None:
        embedded_server(run.stop_db_dir).stop()


def use_tools(run: RunState) -> None:
    """The MCP servers of ``--mcp_config``, the built-in calculator over stdio (started by each sampler), or none."""
    config = run.config
    if config.mcp_config == "none":
        say("tools: none")
        return
    mcp_config = config.mcp_config
    if not mcp_config:  # the console script's command line: the same file (and evaluation key) as ever
        mcp_config = str(run.dir / "mcp.json")
        server = {"name": "calculator", "command": str(Path(sys.executable).with_name("agentrl")),
                  "args": ["tools", "serve", "calculator"]}
        Path(mcp_config).write_text(json.dumps({"servers": [server]}) + "\n", encoding="utf-8")
    say(f"tools: MCP servers of {mcp_config}")
    run.tools = {"mcp_config": mcp_config}


def use_env(run: RunState) -> Path:
    """One AgentGym server of ``--env`` for every sampler and evaluation (``--env_server``, else `agentrl envs
    serve` started here), and its task files: the held-out test split (``run.eval_tasks``) and, unless
    ``--mode eval``, the train split, returned."""
    config = run.config
    assert config.env is not None
    url = config.env_server
    if not url:
        server = run.processes.start("env-server", [*AGENTRL, "envs", "serve", config.env, "--port", "0"])
        pattern = rf"agentrl envs: serving {re.escape(config.env)} at (http\S*)"
        url = run.processes.wait_until_ready(server, pattern, 300)[1]
    say(f"environment: {config.env} at {url} (log {run.logs / 'env-server.log'})")
    run.tools = {"env_server": [f"{config.env}={url}"]}
    train_tasks, test_tasks = run.dir / "env-train.jsonl", run.dir / "env-test.jsonl"
    command = [*AGENTRL, "envs", "tasks", config.env, "--split"]
    failure = f"`agentrl envs tasks {config.env}` failed"
    if config.mode == "rl":
        number = ["--num", str(config.num_tasks)] if config.num_tasks else []
        call(run, "env-tasks", [*command, "train", "--seed", "0", *number, "--output", str(train_tasks)], failure)
    if config.mode == "eval" or config.num_eval_tasks:
        number = ["--num", str(config.num_eval_tasks)] if config.num_eval_tasks else []
        call(run, "env-tasks", [*command, "test", "--seed", "0", *number, "--output", str(test_tasks)], failure)
        run.eval_tasks = test_tasks
    return train_tasks


def upload_tasks(run: RunState, tasks: Path, limit: int | None = None) -> None:
    """The first ``limit`` tasks of ``tasks`` into the train split, every one scored by ``--scorer`` if set."""
    config = run.config
    if limit is not None or config.scorer:
        selected = run.dir / "tasks.jsonl"
        with open(tasks, encoding="utf-8") as lines, open(selected, "w", encoding="utf-8") as out:
            for number, line in enumerate(lines):
                if limit and number >= limit:
                    break
                task = json.loads(line)
                if config.scorer:
                    task["scorer"] = config.scorer
                out.write(json.dumps(task) + "\n")
        tasks = selected
    call(run, "tasks-upload", [*AGENTRL, "tasks", "upload", str(tasks), "--db_connection_string", run.database_uri(),
                               "--split", "train", "--num_generations", str(config.num_generations)],
         f"the upload of {tasks} failed")


def engine_flags(config: RunConfig) -> list[str]:
    """The engine section's flags, for the engines `agentrl eval` starts itself (none: the engine's defaults)."""
    return to_argv(EngineCommandConfig, given_flags(config.engine))


def use_inference(run: RunState, model: str | Path | None) -> None:
    """The SGLang servers of ``--sglang_urls``, or an `agentrl engine` serving ``model`` started here."""
    config = run.config
    if config.sglang_urls:
        run.inference_urls = config.sglang_urls
        say(f"inference: SGLang at {config.sglang_urls}")
        return
    flags = config.flags("engine", **model_flag(model), port=0, db_connection_string=run.database_uri(),
                         **({"enable_lora": True} if config.lora_publish == "adapter" else {}))
    engine = run.processes.start("engine", [*AGENTRL, "engine", *to_argv(EngineCommandConfig, flags)])
    say(f"inference: starting agentrl engine on {model or EMBEDDED_MODEL} (log {engine.log})")
    ready = run.processes.wait_until_ready(engine, r"agentrl engine ready at (http:\S*).*", config.engine_startup_s)
    run.inference_urls = ready[1]
    say(f"inference: {ready[0]}")


def load_weights(model: Path, urls: str) -> None:
    """Make the SGLang servers ``urls`` serve ``model`` as weight version 0."""
    from agentrl.inference.client import SGLangClient

    async def load() -> None:
        for url in filter(None, urls.split(",")):
            async with SGLangClient(url) as client:
                await client.update_weights_from_disk(str(model), weight_version="0")

    asyncio.run(load())
    say(f"inference: the SGLang servers now serve {model}")


def held_out_eval(run: RunState, label: str, **model: Any) -> None:
    """Score the first ``--num_eval_tasks`` held-out tasks greedily with the model the flags ``model`` name
    (``model_name_or_path``: an engine started for it; ``inference_urls``: live services); the result goes to
    ``RUN_DIR/eval-LABEL.json`` and into the summary."""
    config, started, tasks = run.config, time.monotonic(), run.eval_tasks or run.config.eval_tasks
    assert tasks is not None
    out, log = run.dir / f"eval-{label}.json", run.logs / f"eval-{label}.log"
    say(f"held-out evaluation ({label}): {config.num_eval_tasks} tasks of {tasks.name}, greedy "
        f"(log {log})")
    engine = engine_flags(config)
    flags = config.flags("eval", tasks=str(tasks), limit=config.num_eval_tasks, name=f"{run.name} {label}",
                         db_connection_string=run.database_uri(), **run.tools, temperature=0, force=True,
                         max_concurrent_samples_per_process=HELD_OUT_CONCURRENCY,
                         **({"engine_args": engine} if engine else {}), **model)
    done = run.processes.call(f"eval-{label}", [*AGENTRL, "eval", *to_argv(EvalConfig, flags), "--output", str(out),
                                                *shlex.split(config.extra_eval_flags)], log=log)
    if done.status != 0:
        print(done.tail(20), end="", flush=True)
        raise RunFailed(f"the held-out evaluation ({label}) failed")
    run.eval_results += ["--eval", f"{label}={out}"]
    metrics = json.loads(out.read_text(encoding="utf-8"))["metrics"]

    def rate(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    print(f"  {label}: accuracy {rate(metrics['accuracy'])} ({metrics['correct']}/{metrics['valid_samples']}), "
          f"mean reward {rate(metrics['mean_reward'])}, {metrics['errors']} errors "
          f"({int(time.monotonic() - started)} s)", flush=True)


def lora_flags(config: RunConfig) -> dict[str, Any]:
    """Rank-``--lora_r`` adapters on every linear layer, alpha 32 at every rank (the update's scale, and the
    learning rate that suits it, do not depend on the rank), no dropout (it would make the trainer's logprobs
    noisy next to the engine's); none for full fine-tuning."""
    if not config.lora_r:
        return {}
    return {"use_peft": True, "lora_r": config.lora_r, "lora_alpha": 32.0, "lora_target_modules": ["all-linear"],
            "lora_dropout": 0.0, "lora_publish": config.lora_publish}


def warm_up(run: RunState, base: str | None) -> Path:
    """Supervised warm start (CrossEntropy) on ``--warmup`` demonstrations — of ``--warmup_tasks`` made with the real
    tools (`agentrl sft demos`), or the environment's oracle episodes — in a database of its own; the model."""
    config, started = run.config, time.monotonic()
    out, log = run.dir / "warmup", run.logs / "warmup.log"
    out.mkdir(parents=True, exist_ok=True)
    warm_db = run.database_uri(f"{run.name}-warmup")
    if config.env:
        say(f"warm-up: SFT on {config.warmup} oracle demonstrations of {config.env} train tasks (log {log})")
        demos = [*AGENTRL, "envs", "demos", config.env, "--num", str(config.warmup), "--split", "train", "--seed",
                 "1", "--output", str(out / "demos.jsonl")]
    else:
        made_with = "real tool calls" if run.tools else "worked solutions"
        rate = config.section_value("warmup_trainer", "learning_rate")
        lora = f"; rank-{config.lora_r} LoRA at {rate}" if config.lora_r else ""
        say(f"warm-up: SFT on {config.warmup} demonstrations of {config.warmup_tasks.name} ({made_with}{lora}; "
            f"log {log})")
        demos = [*AGENTRL, "sft", "demos", str(config.warmup_tasks), "--limit", str(config.warmup),
                 "--answer_schema", config.value("answer_schema"), "--tools", "",
                 *(["--mcp_config", run.tools["mcp_config"]] if run.tools else []), *run.prompt_flags,
                 "--out", str(out / "demos.jsonl")]
    upload = [*AGENTRL, "sft", "upload", str(out / "demos.jsonl"), "--db_connection_string", warm_db,
              *model_flags(base)]
    flags = config.flags("warmup_trainer", db_connection_string=warm_db, **model_flag(base),
                         loss_calculater="CrossEntropy", enable_sampling=False, save_steps=0, output_dir=str(out),
                         **lora_flags(config))
    train = [sys.executable, "-m", "agentrl.train", *to_argv(TrainConfig, flags)]
    log.write_bytes(b"")
    for command in (demos, upload, train):
        done = run.processes.call("warmup", command, log=log, append=True)
        if done.status != 0:
            print(done.tail(20), end="", flush=True)
            raise RunFailed("the warm-up failed")
    losses = re.findall(r"step [0-9]* \| loss [0-9.e-]*", log.read_text(encoding="utf-8", errors="replace"))
    if losses:
        print("  " + "; ".join(losses), flush=True)
    say(f"warm-up done in {int(time.monotonic() - started)} s: {out / 'final'}")
    return out / "final"


def start_samplers(run: RunState, model: str | Path | None) -> None:
    """``--num_samplers`` `agentrl sample` processes on the run's tasks, tools and inference services."""
    config = run.config
    flags = config.flags("sampler", db_connection_string=run.database_uri(), **model_flag(model), **run.tools,
                         inference_urls=comma_list(run.inference_urls))
    for number in range(config.num_samplers):
        run.samplers.append(run.processes.start(f"sampler-{number}", [
            *AGENTRL, "sample", *to_argv(SamplerConfig, flags), *shlex.split(config.extra_sample_flags)]))
    say(f"samplers: {config.num_samplers} process(es) (logs {run.logs}/sampler-*.log)")


def stop_samplers(run: RunState) -> None:
    """Stop the samplers once the trainer is done: what they would still sample trains nothing, and it would take
    the engine and the CPU from the final evaluation (their running trajectories end ``cancelled``)."""
    for child in run.samplers:
        run.processes.stop(child)
    say(f"samplers: {len(run.samplers)} stopped, the trainer is done")


def trainer_launcher(config: RunConfig) -> list[str]:
    """``accelerate launch`` with ``--accelerate_config``, else torchrun for ``--nproc`` > 1, else one process."""
    scripts = Path(sys.executable).parent
    if config.accelerate_config:
        return [str(scripts / "accelerate"), "launch", "--config_file", str(config.accelerate_config), "-m",
                "agentrl.train"]
    if config.nproc > 1:
        return [str(scripts / "torchrun"), "--nproc_per_node", str(config.nproc), "-m", "agentrl.train"]
    return [sys.executable, "-m", "agentrl.train"]


def train(run: RunState, model: str | Path | None) -> None:
    """The trainer, with the live status line (`agentrl watch`) until it exits; :class:`RunFailed` if it fails."""
    config = run.config
    steps, rate = config.section_value("trainer", "max_steps"), config.section_value("trainer", "learning_rate")
    lora = (f" with rank-{config.lora_r} LoRA adapters at {rate}, published {config.lora_publish},"
            if config.lora_r else "")
    time_s = config.section_value("trainer", "max_train_time_s")
    budget = f" for {time_s:.0f} s, at most" if time_s else " up to"
    say(f"trainer: {config.loss_name},{lora}{budget} {steps if steps > 0 else 'any number of'} steps of "
        f"{config.value('train_batch_size')} samples (log {run.logs / 'trainer.log'}, output {config.output_dir})")
    flags = config.flags("trainer", db_connection_string=run.database_uri(), **model_flag(model),
                         output_dir=str(config.output_dir), **lora_flags(config))
    trainer = run.processes.start("trainer", [
        *trainer_launcher(config), *to_argv(TrainConfig, flags), *shlex.split(config.loss_flags),
        *shlex.split(config.extra_train_flags)])
    watch = run.processes.start("watch", [*AGENTRL, "watch", "--db_connection_string", run.database_uri(),
                                          "--until_pid", str(trainer.pid), "--label", config.loss_name], log=None)
    while watch.status is None:
        trainer.status  # noqa: B018  reaps the trainer once it exits, so that `watch --until_pid` sees it gone
        time.sleep(0.2)
    run.processes.wait(watch)
    status = run.processes.wait(trainer)
    if status != 0:
        print(trainer.tail(30), end="", flush=True)
        raise RunFailed(f"the trainer failed with exit status {status} (log {trainer.log})")


def report(run: RunState) -> None:
    """`agentrl report`: the summary of the run with its held-out evaluations, also in ``RUN_DIR/summary.json``."""
    print(flush=True)
    steps = run.config.section_value("trainer", "max_steps")
    call(run, "report", [*AGENTRL, "report", "--db_connection_string", run.database_uri(), *run.eval_results,
                         "--wall_s", str(int(time.monotonic() - run.started)), "--out", str(run.dir / "summary.json"),
                         *(["--train_steps", str(steps)] if steps > 0 else [])],
         "`agentrl report` failed")


def _size(path: Path) -> int:
    """Bytes in the files under ``path``."""
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def drop_published_weights(run: RunState) -> None:
    """Remove ``OUTPUT_DIR/weights``, the copies of the policy the trainer published for the inference services:
    once RL and the final evaluation are over nothing loads them (the trained model is ``OUTPUT_DIR/final``)."""
    weights = run.config.output_dir / "weights"
    if weights.is_dir():
        size = _size(weights)
        shutil.rmtree(weights)
        say(f"removed the published weights ({size / 2**20:,.0f} MiB in {weights}; nothing loads them any more)")


def _size_of_checkpoints(output: Path) -> str:
    """The size of ``output/checkpoint-*`` in GiB or MiB."""
    size = sum(_size(path) for path in output.glob("checkpoint-*") if path.is_dir())
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:,.0f} MiB"


def summary(run: RunState) -> None:
    """Where everything is: summary, model, checkpoints, trajectories, dashboard, logs."""
    output, uri, stopped = run.config.output_dir, run.database_uri(), run.stop_db_dir
    dashboard_db = '"$MONGO_URI"' if run.config.mongo_uri else f"'{run.db_base}/{run.db_query}'"  # no credentials
    restart = f"agentrl db start --data_dir {stopped} && " if stopped else ""
    print(flush=True)
    say(f"run {run.name} finished")
    lines = [
        f"  summary:           {run.dir}/summary.json   (agentrl status --db_connection_string '{uri}' for the "
        "details)",
        f"  trained model:     {output}/final   (agentrl chat --model_name_or_path {output}/final)",
        f"  checkpoints:       {output}/checkpoint-*   ({_size_of_checkpoints(output)}: model and optimizer "
        "state, to go on with --resume_from_checkpoint; delete them if you will not)",
        f"  trajectories:      database {run.name} — agentrl export --db_connection_string '{uri}' --out "
        "records.jsonl",
        f"                     or Mongo Compass on {uri.rsplit('/', 1)[0]} (collections Record, "
        "DispatchedSamplingTask)"]
    if stopped:
        lines.append(f"                     (the embedded database stopped with this run: agentrl db start "
                     f"--data_dir {stopped})")
    lines += [f"  dashboard:         {restart}agentrl dashboard --db_connection_string {dashboard_db}",
              f"                     then open http://127.0.0.1:8080/runs/{run.name} (curves, records, every token)",
              f"  logs:              {run.logs}"]
    print("\n".join(lines), flush=True)


def evaluate(run: RunState, tasks: Path) -> None:
    """--mode eval: one `agentrl eval` of ``--model`` on ``tasks`` (on the run's services, else on an engine of its
    own with the engine section's flags), its output shown and in ``logs/eval.log``."""
    config = run.config
    engine = engine_flags(config)
    served = ({"inference_urls": comma_list(run.inference_urls)} if run.inference_urls
              else {"engine_args": engine} if engine else {})
    flags = config.flags("eval", db_connection_string=run.database_uri(), **model_flag(config.model),
                         **served, **run.tools, tasks=str(tasks),
                         **({"scorer": config.scorer} if config.scorer is not None else {}), name=run.name,
                         **({"limit": config.num_eval_tasks} if config.num_eval_tasks else {}))
    done = run.processes.call_showing("eval", [*AGENTRL, "eval", *to_argv(EvalConfig, flags), "--output",
                                               str(run.dir / "eval.json"), *shlex.split(config.extra_eval_flags)])
    if done.status != 0:
        raise RunFailed(f"the evaluation failed (log {run.logs / 'eval.log'})")
    say(f"result: {run.dir / 'eval.json'}; database {run.name}, collection Eval (agentrl status "
        f"--db_connection_string '{run.database_uri()}')")
