"""Run untrusted Python code in a sandboxed subprocess (the ``python`` tool).

Each run gets a fresh temporary directory as its working directory (deleted afterwards), a minimal
environment (no inherited variables, so no secrets), ``python -I`` (isolated mode), and these limits:

- **no network**: by default the child runs in a new, empty network namespace (``unshare --net
  --map-root-user``: not even loopback is up), when the kernel allows it. Where it does not, the child installs
  an audit hook (PEP 578) before running the code, which refuses to create non-Unix sockets, to resolve host
  names, to start processes (``subprocess``, ``os.system``, ``os.exec*``, ``fork``, ...) and to load or look up
  native functions through ``ctypes`` (``import ctypes`` and its types still work, so numpy does); audit hooks
  cannot be removed by Python code. This fallback is best effort: code that corrupts memory through ``ctypes``
  types could still get past it.
  ``SandboxResult.isolation`` tells which mode ran.
- ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_AS`` (address space), ``RLIMIT_FSIZE`` (file size), no core dumps;
- a wall-clock timeout, after which the whole process group is killed;
- captured output is bounded: once it exceeds the limit the process is killed and the output truncated.

This contains mistakes and runaway code from a policy model; it is not a boundary against a determined
attacker (the file system is not isolated) — run the server in a container for that.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Literal

from pydantic import BaseModel, Field

_KILL_GRACE_S = 5.0

_BOOTSTRAP = r"""
import resource, runpy, sys, traceback
memory, cpu, fsize, audit = (int(v) for v in sys.argv[1:5])
for kind, soft, hard in (
    (resource.RLIMIT_AS, memory, memory),
    (resource.RLIMIT_CPU, cpu, cpu + 1),
    (resource.RLIMIT_FSIZE, fsize, fsize),
    (resource.RLIMIT_CORE, 0, 0),
):
    current_soft, current_hard = resource.getrlimit(kind)
    if current_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, current_hard), min(hard, current_hard)
    resource.setrlimit(kind, (soft, hard))
_NETWORK = {"socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.gethostbyname_ex"}
_BLOCKED = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
            "pty.spawn", "ctypes.dlsym", "ctypes.dlsym/handle"}
def _guard(event, args):
    if (event == "socket.__new__" and args[1] != 1) or event in _NETWORK:  # 1 == AF_UNIX
        raise PermissionError("network access is disabled in this sandbox")
    if event in _BLOCKED or (event == "ctypes.dlopen" and args[0] is not None):
        raise PermissionError(f"{event} is disabled in this sandbox")
if audit:
    sys.addaudithook(_guard)
del resource, _guard
sys.argv = ["main.py"]
try:
    runpy.run_path("main.py", run_name="__main__")
except SystemExit:
    raise
except BaseException as exc:  # show the user's frames only, not this bootstrap's
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != "main.py":
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)
    sys.exit(1)
"""


class SandboxConfig(BaseModel):
    """Limits of one sandboxed run."""

    timeout_s: float = Field(10.0, gt=0, description="wall-clock limit")
    cpu_seconds: int = Field(10, ge=1, description="RLIMIT_CPU")
    memory_mb: int = Field(1024, ge=64, description="RLIMIT_AS (address space)")
    max_file_mb: int = Field(64, ge=1, description="RLIMIT_FSIZE")
    max_output_chars: int = Field(8000, ge=100, description="stdout + stderr returned to the model")
    network: Literal["auto", "namespace", "audit"] = Field(
        "auto", description="namespace: empty network namespace; audit: audit-hook fallback; auto: the first that works"
    )
    python: str = Field(default_factory=lambda: sys.executable, description="interpreter that runs the code")


class SandboxResult(BaseModel):
    """What a run produced and how it ended."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool = False
    cpu_limited: bool = False
    output_limited: bool = Field(False, description="stopped because it printed more than the output limit")
    truncated: bool = False
    elapsed_s: float
    isolation: Literal["namespace", "audit"]

    def text(self, config: SandboxConfig) -> str:
        """The report the model reads: output first, then how the run ended."""
        parts = [self.stdout.rstrip("\n")] if self.stdout else []
        if self.stderr:
            parts.append("[stderr]\n" + self.stderr.rstrip("\n"))
        if self.truncated:
            stopped = "; the program was stopped" if self.output_limited else ""
            parts.append(f"[output truncated to {config.max_output_chars} characters{stopped}]")
        if self.timed_out:
            parts.append(f"[killed: wall-clock limit of {config.timeout_s:g} s exceeded]")
        elif self.cpu_limited:
            parts.append(f"[killed: CPU time limit of {config.cpu_seconds} s exceeded]")
        elif self.exit_code is not None and self.exit_code < 0 and not self.output_limited:
            parts.append(f"[killed by signal {signal.Signals(-self.exit_code).name}]")
        elif self.exit_code and self.exit_code > 0:
            parts.append(f"[exit code {self.exit_code}]")
        if not parts:
            return "(no output; use print() to show results)"
        return "\n".join(parts)


@functools.cache
def network_namespace_available() -> bool:
    """Whether ``unshare --net --map-root-user`` works here (checked once per process)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    try:
        probe = subprocess.run([unshare, "--net", "--map-root-user", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


def _isolation(config: SandboxConfig) -> Literal["namespace", "audit"]:
    if config.network == "audit":
        return "audit"
    if network_namespace_available():
        return "namespace"
    if config.network == "namespace":
        raise RuntimeError("network namespaces are not available here (unshare --net --map-root-user failed)")
    return "audit"


def _kill_group(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


async def _pump(stream: asyncio.StreamReader, sink: bytearray, limit: int, overflow: asyncio.Event) -> None:
    while chunk := await stream.read(65536):
        room = limit - len(sink)
        sink += chunk[: max(room, 0)]
        if len(chunk) > room:
            overflow.set()
            return


async def run_python(code: str, config: SandboxConfig | None = None) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh temporary directory under the limits of ``config``."""
    config = config or SandboxConfig()
    isolation = _isolation(config)
    byte_limit = config.max_output_chars * 4
    with tempfile.TemporaryDirectory(prefix="agentrl-sandbox-") as workdir:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as handle:
            handle.write(code)
        argv = [
            config.python, "-I", "-c", _BOOTSTRAP,
            str(config.memory_mb * 1024 * 1024), str(config.cpu_seconds), str(config.max_file_mb * 1024 * 1024),
            "1" if isolation == "audit" else "0",
        ]
        if isolation == "namespace":
            argv = [shutil.which("unshare") or "unshare", "--net", "--map-root-user", *argv]
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        }
        started = time.perf_counter()
        process = await asyncio.create_subprocess_exec(
            *argv, cwd=workdir, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
        )
        assert process.stdout is not None and process.stderr is not None
        out, err, overflow = bytearray(), bytearray(), asyncio.Event()
        finished = asyncio.gather(
            _pump(process.stdout, out, byte_limit, overflow),
            _pump(process.stderr, err, byte_limit, overflow),
            process.wait(),
        )
        overflow_wait = asyncio.ensure_future(overflow.wait())
        timed_out = False
        try:
            done, _ = await asyncio.wait(
                {finished, overflow_wait}, timeout=config.timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
            if finished not in done:
                timed_out = not overflow.is_set()
                _kill_group(process)
                # a process that escaped the group may still hold the pipes: stop waiting for them
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(finished, _KILL_GRACE_S)
            exit_code = await process.wait()
        finally:
            overflow_wait.cancel()
            if process.returncode is None:
                _kill_group(process)
                finished.cancel()
                await process.wait()
        elapsed = time.perf_counter() - started
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    truncated = overflow.is_set() or len(stdout) + len(stderr) > config.max_output_chars
    stdout = stdout[: config.max_output_chars]
    stderr = stderr[: max(config.max_output_chars - len(stdout), 0)]
    cpu_limited = exit_code in (-signal.SIGXCPU, -signal.SIGKILL) and not timed_out and not overflow.is_set()
    return SandboxResult(
        stdout=stdout, stderr=stderr, exit_code=exit_code, timed_out=timed_out, cpu_limited=cpu_limited,
        output_limited=overflow.is_set(), truncated=truncated, elapsed_s=elapsed, isolation=isolation,
    )
