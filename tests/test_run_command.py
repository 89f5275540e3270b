"""`agentrl run`: its options (every one documented, every example-script variable one of them, the derived
defaults), and that a stop signal to it stops every process it started, children and grandchildren, checked by PID.
The full run itself is tested through `minirl_example.sh` (test_example_scripts.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agentrl.run.config import SECTIONS, SHORT_NAMES, RunConfig
from agentrl.run.layers import resolve
from agentrl.store.embedded import embedded_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
AGENTRL = [sys.executable, "-m", "agentrl.cli.main"]


def test_help_documents_every_option() -> None:
    done = subprocess.run([*AGENTRL, "run", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    options = done.stdout.split("\noptions:\n")[1]
    blocks = {block.split()[0].lstrip("-"): " ".join(block.split()) for block in re.split(r"\n  (?=-)", options)}
    for name, field in RunConfig.model_fields.items():
        if name in SECTIONS:
            assert f"--{name}.FLAG" in done.stdout, f"the {name} section is not explained"
            continue
        assert field.description, name
        assert name in blocks, f"--{name} missing from `agentrl run --help`"
        assert "default" in blocks[name], f"--{name}: no default in its help: {blocks[name]}"
    for name, (section, flag) in SHORT_NAMES.items():
        assert f"--{section}.{flag}" in blocks[name], blocks[name]


@pytest.mark.parametrize("variables", ["RL_VARIABLES", "EVAL_VARIABLES"])
def test_every_script_variable_is_an_option(variables: str) -> None:
    """Every variable the example scripts read becomes an `agentrl run` option (`run_flags` of example_lib.sh, with
    every variable set); SCORER is passed apart (set but empty means something)."""
    script = f'source scripts/example_lib.sh; run_flags "${{{variables}[@]}}"; printf "%s\\n" "${{RUN_FLAGS[@]}}"'
    names = subprocess.run(["bash", "-c", f'source scripts/example_lib.sh; printf "%s\\n" "${{{variables}[@]}}"'],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    env = {**os.environ, **{name.partition(":")[0]: "1" for name in names}}
    flags = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, check=True,
                           env=env).stdout.split()
    assert len(flags) == len(names) > 20
    for flag in flags:
        option = flag.removeprefix("--").partition("=")[0]
        assert option in SHORT_NAMES or (option in RunConfig.model_fields and option not in SECTIONS), \
            f"{flag}: no such option"
    assert "SCORER" not in names or variables == "EVAL_VARIABLES"


def test_example_scripts_are_thin() -> None:
    for script in ("minirl_example.sh", "grpo_example.sh", "eval_example.sh"):
        assert len((ROOT / script).read_text().splitlines()) <= 60, script
    assert len((ROOT / "scripts/example_lib.sh").read_text().splitlines()) <= 100


def test_the_presets_and_the_derived_defaults() -> None:
    def config(preset: str = "cpu-demo", **flags: object) -> RunConfig:
        return resolve(flags, preset).config

    plain = config(run_name="r")
    assert (plain.num_tasks, plain.section_value("sampler", "rounds"), plain.scorer, plain.warmup,
            plain.value("max_turns"), plain.value("temperature")) == (200, 1, "math", 32, 2, 0.7)
    assert (plain.section_value("trainer", "learning_rate"), plain.section_value("warmup_trainer", "learning_rate"),
            plain.value("max_new_tokens")) == (2e-6, 1e-4, 48)
    assert plain.num_eval_tasks == 64 and config(num_eval_tasks=0).num_eval_tasks == 0
    assert (plain.section_value("trainer", "max_train_time_s"), plain.section_value("trainer", "max_steps")) == (
        330.0, 100)  # RL bounded by time
    assert plain.run_dir == ROOT / "runs" / "r" and plain.output_dir == ROOT / "runs" / "r" / "output"
    own_model = config(model="m")
    assert own_model.warmup == 0 and own_model.run_name.startswith("minirl-")
    assert own_model.scorer == "math_format" and config(model="m", warmup=8).scorer == "math"
    env = config(env="textcraft", lora_r=8)
    assert (env.num_tasks, env.section_value("sampler", "rounds"), env.scorer, env.warmup,
            env.section_value("warmup_trainer", "num_train_epochs"), env.value("max_turns"),
            env.value("temperature")) == (0, 1, "", 64, 2, 12, 1.0)
    assert (env.section_value("trainer", "learning_rate"), env.section_value("warmup_trainer", "learning_rate"),
            env.num_eval_tasks) == (5e-5, 2e-3, 32)
    assert (env.section_value("trainer", "max_train_time_s"), env.section_value("trainer", "max_steps")) == (0.0, 32)
    assert config(env="sciworld").warmup == 0
    assert config(env="textcraft", scorer="math", warmup=0, temperature=0.5).model_dump(
        include={"scorer", "warmup", "temperature"}) == {"scorer": "math", "warmup": 0, "temperature": 0.5}
    evaluation = config("cpu-eval", mode="eval", env="babyai")
    assert (evaluation.scorer, evaluation.num_eval_tasks, evaluation.value("max_new_tokens"),
            evaluation.value("max_turns"), evaluation.value("temperature")) == ("math", 8, 128, 12, 0.7)
    assert evaluation.eval_tasks.name == "arith_tools.jsonl" and evaluation.run_name.startswith("eval-")
    # No preset: every value is its component's default
    bare = resolve({}).config
    assert (bare.value("temperature"), bare.value("train_batch_size"), bare.value("max_turns"),
            bare.section_value("trainer", "learning_rate"), bare.warmup) == (1.0, 16, 8, 1e-6, 0)


@pytest.mark.parametrize(("flags", "message"), [
    (["--lora_publish", "adapter"], "--lora_publish adapter needs --lora_r"),
    (["--extra_train_flags", "--seed '1"], "--extra_train_flags: No closing quotation"),
    (["--lora_publish", "full"], "invalid choice: 'full'"),
    (["--num_tasks", "-1"], "--num_tasks: Input should be greater than or equal to 0"),
])
def test_bad_options_are_refused_with_the_flag_named(flags: list[str], message: str, tmp_path: Path) -> None:
    done = subprocess.run([*AGENTRL, "run", "--run_dir", str(tmp_path / "run"), *flags], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()  # refused before anything started


def _processes() -> dict[int, tuple[int, str, str]]:
    """pid → (parent pid, start time, state) of every process."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            table[int(entry.name)] = (int(fields[1]), fields[19], fields[0])
    return table


def _descendants(root: int) -> dict[int, str]:
    """pid → start time of every live descendant of ``root``."""
    table, found, frontier = _processes(), {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, started, _state) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = started
                frontier.append(pid)
    return found


def _still_running(seen: dict[int, str]) -> list[str]:
    table = _processes()
    left = []
    for pid, started in seen.items():
        if pid in table and table[pid][1] == started and table[pid][2] != "Z":
            command = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ")
            left.append(f"{pid}: {command[:200]!r}")
    return left


def _engine_of_an_eval(seen: dict[int, str]) -> bool:
    """Whether an `agentrl engine` runs under an `agentrl eval` (a grandchild the eval started)."""
    table = _processes()
    commands = {}
    for pid in seen:
        try:
            commands[pid] = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
    return any(b"engine" in command and b"eval" in commands.get(table.get(pid, (0,))[0], [])
               for pid, command in commands.items())


@pytest.mark.parametrize(("sig", "stage"), [(signal.SIGINT, "rl"), (signal.SIGTERM, "eval")])
def test_a_stop_signal_stops_every_process_the_run_started(sig: signal.Signals, stage: str, tmp_path: Path,
                                                           scripted_model_dir: Path) -> None:
    """SIGINT while samplers, trainer and watch run; SIGTERM during the held-out evaluation, whose `agentrl eval`
    has started an engine of its own (a grandchild). Every process seen under the driver is gone afterwards, the
    embedded database is stopped, and the exit status is 128 + the signal."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "question": "What is 9 + 10?", "answer": "19",
                                         "answer_schema": "boxed"}) + "\n" for i in range(4)))
    run_dir, db_dir = tmp_path / "run", tmp_path / "db"
    command = [*AGENTRL, "run", "--preset", "cpu-demo", "--run_name", "stop_test", "--run_dir", str(run_dir),
               "--db_dir", str(db_dir),
               "--model", str(scripted_model_dir), "--tasks", str(tasks), "--eval_tasks", str(tasks),
               "--num_eval_tasks", "1" if stage == "eval" else "0", "--warmup", "0", "--engine_threads", "1",
               "--train_steps", "100", "--max_new_tokens", "40", "--max_turns", "3"]
    driver = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={k: v for k, v in os.environ.items() if k != "AGENTRL_DB"})
    seen: dict[int, str] = {}
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(driver.stdout or []), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        ready = False
        while not ready:
            assert time.monotonic() < deadline and driver.poll() is None, "".join(output)
            seen.update(_descendants(driver.pid))
            text = "".join(output)
            if stage == "rl":
                ready = "trainer: MINIRL" in text and "step 0" in text
            else:
                ready = "held-out evaluation (before)" in text and _engine_of_an_eval(seen)
            time.sleep(0.2)
        driver.send_signal(sig)
        while driver.poll() is None:  # processes started while it stops count too
            seen.update(_descendants(driver.pid))
            assert time.monotonic() < deadline + 120, "the run did not stop"
            time.sleep(0.1)
        reader.join(10)
    finally:
        if driver.poll() is None:
            driver.kill()
    text = "".join(output)
    assert driver.returncode == 128 + sig, text[-3000:]
    assert f"stopped by {sig.name}" in text, text[-3000:]
    assert len(seen) >= (5 if stage == "rl" else 3), seen  # database, engine, sampler, trainer, watch / eval, engine
    time.sleep(1)
    assert _still_running(seen) == [], text[-3000:]
    assert embedded_server(db_dir).pid() is None


def test_a_failing_stage_ends_the_run_with_its_message(tmp_path: Path) -> None:
    """An invalid task file: the upload fails, the run says so and exits 1, and the database it started is
    stopped (nothing else was started yet)."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "t1", "question": "What is 9 + 10?"}\n')  # no answer
    db_dir = tmp_path / "db"
    done = subprocess.run([*AGENTRL, "run", "--preset", "cpu-demo", "--run_name", "fail_test",
                           "--run_dir", str(tmp_path / "run"),
                           "--db_dir", str(db_dir), "--tasks", str(tasks), "--scorer="],
                          capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "AGENTRL_DB"})
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"the upload of {tmp_path / 'run' / 'tasks.jsonl'} failed" in done.stdout, done.stdout
    assert "tasks.jsonl:1" in done.stderr  # the upload's own report of the invalid line
    assert embedded_server(db_dir).pid() is None
