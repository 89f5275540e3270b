"""The GPU check's kit and its dry run, so that both work the day a GPU machine is lent.

``scripts/gpu_wheels.sh`` downloads the kit (about 30 MiB of wheels from PyPI; kept in pytest's cache per kit
definition and requirements), and ``scripts/gpu_check.sh --dry-run`` installs it into a target for Python 3.12,
checks this environment's requirements and imports, and each CUDA step's arguments.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
KIT_LIMIT = 48 * 2**20
TRAVEL_LIMIT = 64 * 2**20
CHECKS = ["install", "environment", "imports", "pytest_gpu", "bench_trainer", "bench_engine", "decode_attn", "publish",
          "rl_loop"]
CUDA_CHECKS = CHECKS[3:]


@pytest.fixture(scope="module")
def kit(request: pytest.FixtureRequest) -> Path:
    definition = b"".join((ROOT / name).read_bytes() for name in (
        "scripts/gpu/kit.py", "scripts/gpu/image_packages.txt", "requirements.txt", "pyproject.toml"))
    path = Path(request.config.cache.mkdir("gpu-kit")) / hashlib.sha256(definition).hexdigest()[:16]
    done = subprocess.run([str(ROOT / "scripts" / "gpu_wheels.sh"), str(path)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "MiB" in done.stdout.splitlines()[-1], done.stdout
    return path


def tree_bytes() -> int:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / name.decode()).stat().st_size for name in listed if name and (ROOT / name.decode()).is_file())


def test_the_kit_fits_and_holds_what_the_image_lacks(kit: Path) -> None:
    manifest = json.loads((kit / "kit.json").read_text())
    wheels = manifest["wheels"]
    for name in ("pydantic", "pydantic-core", "pymongo", "nx-27017", "fastapi", "uvicorn", "mcp", "openai",
                 "transformers", "tokenizers", "pytest-asyncio", "bitsandbytes"):
        assert name in wheels, name
    assert wheels["transformers"]["version"] == "5.23.0"
    for name in ("torch", "numpy", "accelerate", "httpx", "safetensors", "jinja2"):  # the image has them
        assert name not in wheels, name
    assert sorted(p.name for p in kit.glob("*.whl")) == sorted(w["file"] for w in wheels.values())
    size = sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())
    assert size <= KIT_LIMIT, size
    assert size + tree_bytes() <= TRAVEL_LIMIT
    assert (kit / manifest["tokenizer"] / "tokenizer.json").is_file()
    with zipfile.ZipFile(kit / wheels["bitsandbytes"]["file"]) as trimmed:  # only CUDA 13.0 and the CPU build left
        libraries = sorted(n.split("/")[-1] for n in trimmed.namelist() if n.endswith(".so"))
        record = trimmed.read(next(n for n in trimmed.namelist() if n.endswith("RECORD"))).decode()
    assert libraries == ["libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so"], libraries
    assert "cuda128" not in record


def test_dry_run_lists_every_check_and_skips_the_cuda_ones(kit: Path, tmp_path: Path) -> None:
    done = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run", "--kit", str(kit)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OUT": str(tmp_path)})
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(report["checks"]) == CHECKS
    assert report["dry_run"] and report["device"].startswith("no CUDA device")
    for name in CHECKS[:3]:
        assert report["checks"][name]["status"] == "passed", report["checks"][name]
    assert report["checks"]["install"]["wheels"] == len(list(kit.glob("*.whl")))
    assert report["checks"]["environment"]["unsatisfied"] == []
    assert report["checks"]["imports"]["failed"] == {}
    for name in CUDA_CHECKS:
        entry = report["checks"][name]
        assert entry["status"] == "skipped" and "dry run" in entry["reason"], entry
    log = (tmp_path / "gpu_check.log").read_text()
    assert "dry run: would train a qwen3 model (28 layers, hidden 1024)" in log
    assert "8 tests collected" in log
    profiled = report["checks"]["rl_loop"]["profile"]  # the kit's py-spy ran the dry run, its profile was read
    assert profiled["main"]["samples"] > 0, profiled
    assert any(name.startswith("main (loop.py)") for name, _ in profiled["main"]["inclusive"]), profiled


def test_without_cuda_and_without_dry_run_the_cuda_checks_fail(kit: Path, tmp_path: Path) -> None:
    done = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--kit", str(kit), "--only", "environment",
                           "bench_trainer"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OUT": str(tmp_path), "PYTHON": str(ROOT / ".venv/bin/python")})
    assert done.returncode == 1, done.stdout + done.stderr
    checks = json.loads((tmp_path / "gpu_check.json").read_text())["checks"]
    assert list(checks) == ["install", "environment", "bench_trainer"]  # --only keeps what the others need
    assert checks["bench_trainer"] == {"ok": False, "status": "failed", "seconds": 0.0,
                                       "reason": "no CUDA device (on a machine without one, use --dry-run)"}


def test_a_step_that_fails_runs_its_fallback_and_says_so(tmp_path: Path) -> None:
    import importlib.util
    import io
    import sys

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu" / "check.py")
    check = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = check  # dataclasses look their module up
    spec.loader.exec_module(check)
    ctx = check.Context(python=sys.executable, work=tmp_path, site=tmp_path, kit=tmp_path, dry_run=False,
                        env=dict(os.environ))
    failing = [sys.executable, "-c", "import sys; print('profiler refused'); sys.exit(3)"]
    plain = [sys.executable, "-c", "print('measured')"]
    figures = lambda work, output: {"measured": "measured" in output}  # noqa: E731
    log = io.StringIO()
    entry = check.run_step(check.Step("loop", failing, 60, fallback=plain, figures=figures), ctx, log, 100)
    assert entry["status"] == "passed" and entry["measured"], entry
    assert entry["first_try"] == "exit status 3: profiler refused", entry
    entry = check.run_step(check.Step("loop", failing, 60, figures=figures), ctx, log, 100)
    assert entry["status"] == "failed" and entry["reason"] == "exit status 3: profiler refused", entry
    assert log.getvalue().count("===== loop: exit 3") == 2
