"""The commands `agentrl run` would start for an example script's variables, without starting any: the script runs
for real in a copy of the repository whose `agentrl` only records its arguments; those go through `agentrl run`'s
own parser and driver, whose processes are recorded instead of started. Each command comes back parsed by its own
command's parser (the flags it was given, with their values), so that two runs compare by what each process gets,
not by the order or spelling of its flags."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS: dict[str, tuple[str, dict[str, str]]] = {
    "minirl": ("minirl_example.sh", {}),
    "grpo": ("grpo_example.sh", {}),
    "eval": ("eval_example.sh", {}),
    "minirl-textcraft": ("minirl_example.sh", {"ENV": "textcraft"}),
    "minirl-sciworld": ("minirl_example.sh", {"ENV": "sciworld", "NUM_TASKS": "6"}),
    "minirl-lora": ("minirl_example.sh", {"LORA_R": "8"}),
    "grpo-babyai-lora-adapter": ("grpo_example.sh", {"ENV": "babyai", "LORA_R": "4", "LORA_PUBLISH": "adapter",
                                                     "ENV_SERVER": "http://127.0.0.1:9"}),
    "minirl-model": ("minirl_example.sh", {"MODEL": "/models/m"}),
    "minirl-everything": ("minirl_example.sh", {
        "MODEL": "/models/m", "WARMUP": "8", "WARMUP_EPOCHS": "3", "WARMUP_LEARNING_RATE": "5e-5",
        "WARMUP_THREADS": "1", "LEARNING_RATE": "1e-5", "TEMPERATURE": "0.9", "TRAIN_BATCH_SIZE": "8",
        "MAX_STALENESS": "0", "SYNC_EVERY": "1", "SAMPLES_PER_SAMPLER": "4", "NUM_SAMPLERS": "2", "TRAIN_STEPS": "5",
        "TRAIN_TIME_S": "60", "TRAINER_THREADS": "2", "ENGINE_THREADS": "1", "SAVE_STEPS": "0",
        "SAVE_TOTAL_LIMIT": "2", "MAX_TURNS": "3", "MAX_NEW_TOKENS": "64", "NUM_GENERATIONS": "8", "ROUNDS": "2",
        "NUM_TASKS": "10", "NUM_EVAL_TASKS": "4", "QUERY_PROMPT": "Q: {query}", "SCORER": ""}),
    "grpo-original-flags": ("grpo_example.sh", {
        "SGLANG_URLS": "http://127.0.0.1:9,http://127.0.0.1:10", "MONGO_URI": "mongodb://h:1/?replicaSet=rs",
        "MCP_CONFIG": "none", "NUM_EVAL_TASKS": "0", "NPROC": "2",
        "EXTRA_TRAIN_FLAGS": "--per_device_train_batch_size 2 --optim_args beta2=0.95 --warmup_ratio 0.1 "
                             "--lr_scheduler_type cosine --bf16 false --train_batch_size 4",
        "EXTRA_SAMPLE_FLAGS": "--top_p 1.0 --lease_s 30"}),
    "minirl-accelerate": ("minirl_example.sh", {"ACCELERATE_CONFIG": "assets/accelerate/fsdp2.yml", "WARMUP": "0",
                                                "OUTPUT_DIR": "/tmp/out", "EXTRA_EVAL_FLAGS": "--max_attempts 2"}),
    "eval-babyai": ("eval_example.sh", {"ENV": "babyai", "LIMIT": "3", "K": "4", "TEMPERATURE": "1.0",
                                        "FORCE": "1", "CONCURRENCY": "4", "SEED": "3",
                                        "EXTRA_EVAL_FLAGS": "--max_prompt_tokens 8192"}),
    "eval-model": ("eval_example.sh", {"MODEL": "/models/m", "SGLANG_URLS": "http://127.0.0.1:9", "LIMIT": "0",
                                       "MAX_TURNS": "4", "MAX_NEW_TOKENS": "256", "SCORER": "math_format",
                                       "AGENT_CONFIG": "/tmp/agent.yml", "REPEATS": "2"}),
}
"""Example-script runs: name → (script, its variables)."""


def script_arguments(script: str, variables: dict[str, str], tmp: Path) -> list[str]:
    """The arguments ``script`` gives `agentrl run` with ``variables`` (and the run name ``test``): the script runs
    in a copy of the repository whose set-up does nothing and whose `agentrl` writes its arguments to a file."""
    copy = tmp / "repo"
    (copy / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / script, copy / script)
    shutil.copy(ROOT / "scripts" / "example_lib.sh", copy / "scripts" / "example_lib.sh")
    for name in ("configs", "assets"):
        if (ROOT / name).exists():
            (copy / name).symlink_to(ROOT / name)
    (copy / "scripts" / "setup_venv.sh").write_text("#!/bin/sh\n")
    (copy / ".venv" / "bin").mkdir(parents=True)
    recorder = copy / ".venv" / "bin" / "agentrl"
    recorder.write_text(f"#!/bin/sh\nfor arg in \"$@\"; do printf '%s\\0' \"$arg\"; done > {tmp}/argv\n")
    for path in (copy / script, copy / "scripts" / "setup_venv.sh", recorder):
        path.chmod(0o755)
    env = {key: value for key, value in os.environ.items() if not re.fullmatch(r"[A-Z_]+", key) or key in (
        "PATH", "HOME", "LANG", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    env.update(variables, RUN_DIR=str(tmp / "run"))
    subprocess.run(["bash", str(copy / script), "test"], env=env, check=True, timeout=60)
    arguments = (tmp / "argv").read_bytes().decode().split("\0")[:-1]
    assert arguments[0] == "run", arguments
    return [argument.replace(str(copy), str(ROOT)) for argument in arguments[1:]]


@dataclass
class _Child:
    name: str
    log: Path | None
    command: list[str]
    status: int = 0
    pid: int = 1

    def tail(self, lines: int) -> str:
        return ""


@dataclass
class RecordingProcesses:
    """Stands in for :class:`agentrl.run.processes.Processes`: records each command and pretends it succeeded
    (an evaluation writes its result file, a server prints its ready line)."""

    log_dir: Path
    commands: list[tuple[str, list[str]]] = field(default_factory=list)

    def start(self, name: str, command: list[str], log: Any = True, append: bool = False, pipe: bool = False) -> _Child:
        self.commands.append((name, list(command)))
        if "--output" in command and name.startswith("eval"):
            out = Path(command[command.index("--output") + 1])
            out.write_text(json.dumps({"metrics": {"accuracy": 0.5, "correct": 1, "valid_samples": 2,
                                                   "mean_reward": 0.5, "errors": 0}}))
        return _Child(name, self.log_dir / f"{name}.log", list(command))

    call = call_showing = start

    def wait(self, child: _Child) -> int:
        return 0

    def wait_until_ready(self, child: _Child, pattern: str, timeout_s: float) -> re.Match[str]:
        if child.name == "engine":
            line = "agentrl engine ready at http://127.0.0.1:30000"
        else:  # `agentrl envs serve NAME ...`
            line = f"agentrl envs: serving {child.command[child.command.index('serve') + 1]} at http://127.0.0.1:36000"
        match = re.search(pattern, line)
        assert match, (pattern, child.name)
        return match

    def stop(self, child: _Child) -> None:
        pass


def _parsed(command: list[str]) -> dict[str, Any]:
    """A command as ``{"launcher": ..., "flags": ...}``: for `agentrl train`, `sample` and `eval` (whose flags are
    a model's) the resolved model with the run values it was given (so two spellings of one configuration compare
    equal, but a value given and one left to the run's record do not); for the others the parsed flags."""
    from agentrl import train
    from agentrl.cli.main import build_parser
    from agentrl.config_flags import flag_items, flag_values
    from agentrl.eval.runner import EvalConfig
    from agentrl.inference.engine_config import EngineCommandConfig
    from agentrl.rollout.config import SamplerConfig

    python = sys.executable
    text = [part.replace(python, "python").replace(str(Path(python).parent), "BIN") for part in command]
    if "agentrl.train" in text:
        at = text.index("agentrl.train") + 1
        launcher, args = text[:at], train.build_parser().parse_args(command[at:])
        config = train.config_from_namespace(args, train.build_parser())[0]
        return {"launcher": launcher, "flags": _json({**config.model_dump(), "given": config.run_values(1)})}
    at = text.index("agentrl.cli.main") + 1
    launcher, args = text[:at + 1], build_parser().parse_args(command[at:])
    if launcher[-1] in ("envs", "sft", "tasks", "tools"):
        launcher.append(text[at + 1])
    model = {"sample": SamplerConfig, "eval": EvalConfig}.get(launcher[-1])
    if model is not None:
        resolved = model(**flag_values(model, vars(args)))
        given = resolved.run_values() if isinstance(resolved, SamplerConfig) else {}
        return {"launcher": launcher, "flags": _json({**resolved.model_dump(), "given": given})}
    flags = {key: value for key, value in vars(args).items() if key not in ("func", "_parser", "command", "wall_s")}
    if launcher[-1] == "engine":  # every flag's value (its parser once had them all in its namespace)
        config = EngineCommandConfig(**flag_values(EngineCommandConfig, flags))
        flags = {**flag_items(config), "verbose": flags.get("verbose", False)}
    return {"launcher": launcher, "flags": _json(flags)}


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value, default=lambda item: sorted(item) if isinstance(item, set | frozenset)
                                 else str(item)))


def run_commands(arguments: list[str], tmp: Path) -> list[dict[str, Any]]:
    """The commands `agentrl run ARGUMENTS` starts, in order, each parsed (see :func:`_parsed`), paths under the run
    directory as ``RUN/...``."""
    from agentrl.cli.main import build_parser
    from agentrl.run import driver, stages
    from agentrl.run.stages import RunState

    args = build_parser().parse_args(["run", *arguments])
    config = _resolved(args)
    assert config.run_dir is not None
    (config.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    processes = RecordingProcesses(config.run_dir / "logs")
    run = RunState(config, processes)  # type: ignore[arg-type]

    def embedded(run: RunState) -> None:
        if run.config.mongo_uri:
            return real_database(run)
        run.db_base = "mongodb://127.0.0.1:27017"

    real_database, patched = stages.use_database, {
        "use_database": embedded, "load_weights": lambda model, urls: None, "stop_database": lambda run: None}
    saved = {name: getattr(stages, name) for name in patched}
    try:
        for name, function in patched.items():
            setattr(stages, name, function)
        (driver.evaluate if config.mode == "eval" else driver.train)(run)
    finally:
        for name, function in saved.items():
            setattr(stages, name, function)
    found = []
    for name, command in processes.commands:
        entry = {"name": name, **_parsed(command)}
        found.append(json.loads(json.dumps(entry).replace(str(config.run_dir), "RUN").replace(str(ROOT), "REPO")))
    return found


def _resolved(args: argparse.Namespace) -> Any:
    """`agentrl run`'s configuration of the parsed ``args`` (what its ``run`` function builds)."""
    from agentrl.run.layers import command_line_flags, resolve

    return resolve(command_line_flags(args), args.preset, args.config).config


def scenario_commands(name: str, tmp: Path) -> list[dict[str, Any]]:
    script, variables = SCENARIOS[name]
    return run_commands(script_arguments(script, variables, tmp), tmp)


if __name__ == "__main__":  # python tests/run_commands.py OUT.json: record every scenario
    import tempfile

    recorded = {}
    for scenario in SCENARIOS:
        with tempfile.TemporaryDirectory() as directory:
            recorded[scenario] = scenario_commands(scenario, Path(directory))
    Path(sys.argv[1]).write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
