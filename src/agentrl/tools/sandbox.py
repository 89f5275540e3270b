"""Run untrusted Python code in a sandboxed subprocess (the ``python`` tool).

Each run gets a fresh working directory (deleted afterwards), a minimal environment (no inherited variables, so no
secrets), ``python -I`` (isolated mode), and these limits: ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_AS`` (address
space, per process), ``RLIMIT_FSIZE`` (file size), no core dumps, a wall-clock timeout, and bounded output (past the
limit the run is stopped and the output truncated).

**Isolation.** The code runs in new PID, network, mount, IPC, UTS and cgroup namespaces, set up by bubblewrap
(``bwrap`` 0.8 or later, preferred) or else by util-linux (``unshare``, then ``mount``, ``pivot_root`` and
``setpriv``).
``SandboxConfig.isolation`` picks one; ``SandboxResult.isolation`` records which ran.

- Network: a namespace of its own, whose only interface is a loopback (down with ``unshare``; up with ``bwrap``,
  where only the sandbox itself can listen on it). No port of this machine or beyond can be reached, nor the
  host's abstract Unix sockets.
- File system: a new root holding, read-only, ``/usr`` (and ``/bin``, ``/lib*`` or their symlinks),
  ``/etc/ld.so.cache`` and the interpreter's prefixes (``sys.prefix``, ``sys.base_prefix``: its stdlib and
  site-packages); ``/dev/{null,zero,full,random,urandom}``; a fresh ``/proc`` (``sys``, ``sysrq-trigger``, ``irq``,
  ``bus`` and ``fs`` read-only); a private ``/tmp`` (tmpfs of ``max_file_mb``; ``/dev/shm`` points there); and the
  run's working directory, the only writable host directory. Nothing else of the host is there (the prefixes
  only, even under ``/work`` or ``/root``): not the repository, ``/home``, the host's ``/tmp`` or ``/etc``, task or
  database files. With ``stdlib_only`` the code sees the standard library and no installed package: the
  interpreter outside any virtual environment (``sys._base_executable``) runs it, the virtual environment is not
  mounted, and every ``site-packages`` or ``dist-packages`` directory there (the interpreter's, and Debian's under
  ``/usr/lib/python3*`` and ``/usr/local/lib/python3*``) is an empty read-only directory (in the ``audit`` mode,
  which mounts nothing, only the interpreter changes).
- Processes: a new PID namespace, so ``/proc`` lists only the sandbox's own processes (no other process's
  ``environ`` to read, none to signal). ``RLIMIT_NPROC`` (``max_processes``) contains fork bombs. The interpreter's
  first process is a supervisor (in the ``unshare`` mode the namespace's init) that forks the program: when the
  program ends, or the run is killed on a limit, the namespace ends and every process left in it dies, ``setsid``
  and double-forked ones included. Should the server die, the supervisor's stdin ends and it kills the program.
- User and privileges: no capabilities, ``no_new_privs``. A server running as an unprivileged user (or as root of
  a user namespace, as in rootless containers) runs the code as itself in a new user namespace, in which no further
  user namespace can be made (``RLIMIT_NPROC`` is counted there, per run; it does not hold where that namespace
  maps its root to the host's root, which is exempt from it). A server running as the host's root
  (exempt from ``RLIMIT_NPROC``, able to write ``/proc/sys``) makes the namespaces without a user
  namespace and runs the code as a random unprivileged uid, one per run, from ``ROOT_UIDS``; that code may make
  user namespaces of its own, as any unprivileged user of the machine can.

**Fail closed.** With ``isolation="auto"`` the first mechanism that works here is used (each is tried by running
it). Where none works (neither tool installed, user namespaces disabled or forbidden in a container), a run raises
:class:`SandboxUnavailable`, whose message the ``python`` server returns as the tool's error, unless
``allow_unsandboxed`` is set (``agentrl tools serve python --allow_unsandboxed``). Then code runs with PEP 578 audit
hooks only (``isolation == "audit"``): they refuse non-Unix sockets, name resolution, starting processes through
``os``/``subprocess`` and loading native functions through ``ctypes``, but native code gets past them
(``_posixsubprocess.fork_exec``, ``ctypes`` memory tricks), and the file system and other processes' ``/proc``
entries stay open. Use that mode only for trusted code.

Not isolated, even in namespaces: the kernel (no seccomp filter: any system call the namespaces allow can be made),
memory and CPU in total (limits are per process: up to ``max_processes`` × ``memory_mb``), disk space in the working
directory (only each file's size is limited), and whatever the code's uid may read under the bound directories.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import glob
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Literal

from pydantic import BaseModel, Field

Isolation = Literal["bwrap", "unshare", "audit"]

_KILL_GRACE_S = 5.0
_PROBE_TIMEOUT_S = 30.0
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_DEV_LINKS = (("/proc/self/fd", "/dev/fd"), ("/proc/self/fd/0", "/dev/stdin"), ("/proc/self/fd/1", "/dev/stdout"),
              ("/proc/self/fd/2", "/dev/stderr"), ("/tmp", "/dev/shm"))
_PROC_READ_ONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")  # writable for root, Docker keeps them read-only
TOP_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # directories, or symlinks into /usr
_SBIN = "/usr/sbin:/sbin"  # util-linux's pivot_root lives there, often off an unprivileged user's PATH
_SITE_GLOBS = ("/usr/lib/python3*/*-packages", "/usr/local/lib/python3*/*-packages")  # Debian's, whichever Python

_BOOTSTRAP = r"""
import os, sys
memory, cpu, fsize, nproc, audit, status_fd = (int(v) for v in sys.argv[1:7])
runner = os.fork()
if runner:  # the supervisor: reports how the program ended; its exit ends the sandbox
    import threading
    def _orphaned():  # stdin is a pipe the server never writes to: end of file means the server is gone
        os.read(0, 1)
        os.kill(runner, 9)
    threading.Thread(target=_orphaned, daemon=True).start()
    while (ended := os.waitpid(-1, 0))[0] != runner:  # as a PID namespace's init, it also reaps orphans
        pass
    os.write(status_fd, str(ended[1]).encode())
    os._exit(0)
os.close(status_fd)
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
import resource, runpy, traceback
for kind, soft, hard in (
    (resource.RLIMIT_AS, memory, memory),
    (resource.RLIMIT_CPU, cpu, cpu + 1),
    (resource.RLIMIT_FSIZE, fsize, fsize),
    (resource.RLIMIT_CORE, 0, 0),
    *([(resource.RLIMIT_NPROC, nproc, nproc)] if nproc else []),
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
del os, resource, _guard
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

ROOT_UIDS = range(0x70000000, 0x70000000 + (1 << 20))
"""Under a root server, each run's code runs as a random one of these uids (above the ranges systemd and container
tools allocate); two concurrent runs that drew the same one would share their RLIMIT_NPROC count."""
DROP_PRIVILEGES = ("--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all", "--no-new-privs")

_UNSHARE_SETUP = """set -eu
root=$1 fstab=$2 work=$3
shift 3
{forbid_userns}{mount} --all --fstab "$fstab"
cd "$root"
{pivot_root} . .old
{umount} --lazy .old
{mount} -o remount,bind,ro /
cd "$work"
exec "$@"
"""
"""Runs first in the new namespaces: mounts the layout (``fstab``) on ``root`` and makes it ``/`` (the host's root is
detached), then runs the command (``setpriv``, which drops every capability, then the interpreter)."""


class SandboxUnavailable(RuntimeError):
    """The kernel cannot isolate code here and unsandboxed runs were not allowed."""


class SandboxConfig(BaseModel):
    """Limits of one sandboxed run, and how it is isolated."""

    timeout_s: float = Field(10.0, gt=0, description="wall-clock limit")
    cpu_seconds: int = Field(10, ge=1, description="RLIMIT_CPU")
    memory_mb: int = Field(1024, ge=64, description="RLIMIT_AS (address space), per process")
    max_file_mb: int = Field(64, ge=1, description="RLIMIT_FSIZE, and the size of the sandbox's /tmp")
    max_processes: int = Field(
        32, ge=4, description="RLIMIT_NPROC: processes and threads in the sandbox at once (its supervisor's 2-3 too)"
    )
    max_output_chars: int = Field(8000, ge=100, description="stdout + stderr returned to the model")
    isolation: Literal["auto", "bwrap", "unshare"] = Field(
        "auto", description="namespace mechanism: bwrap, unshare (util-linux), or auto: the first that works here"
    )
    allow_unsandboxed: bool = Field(
        False, description="where the mechanism cannot run, run code with audit hooks only instead of refusing"
    )
    python: str = Field(default_factory=lambda: sys.executable, description="interpreter that runs the code")
    stdlib_only: bool = Field(
        False, description="the standard library only: python's base interpreter runs the code, no site-packages"
    )


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
    isolation: Isolation

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


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The sandbox's file system."""

    read_only: tuple[tuple[str, str], ...]  # (host path, sandbox path)
    symlinks: tuple[tuple[str, str], ...]  # (target, link)
    workdir: str  # bound read-write at the same path
    tmp_bytes: int
    hidden: tuple[str, ...] = ()  # directories under read_only that the empty directory covers
    empty: str = ""  # an empty host directory (with hidden)


@dataclasses.dataclass(frozen=True)
class _Interpreter:
    """What a sandbox runs: the interpreter's executable, the directories it runs from, those to hide."""

    executable: str
    directories: tuple[str, ...]
    hidden: tuple[str, ...]


_DESCRIBE = """import json, site, sys, sysconfig
base = sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_exec_prefix})
print(json.dumps({"prefixes": [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix],
                  "bases": [sys.base_prefix, sys.base_exec_prefix],
                  "base_executable": getattr(sys, "_base_executable", sys.executable),
                  "sites": [*site.getsitepackages(), site.getusersitepackages(), base["purelib"], base["platlib"]]}))
"""


@functools.cache
def _interpreter(python: str, stdlib_only: bool) -> _Interpreter:
    """How ``python`` runs in a sandbox: itself from its prefixes (stdlib, site-packages) and its executable's
    directory; or, ``stdlib_only``, its base interpreter from the base prefixes, every site directory hidden."""
    found = json.loads(subprocess.run([python, "-I", "-c", _DESCRIBE], capture_output=True, text=True,
                                      timeout=_PROBE_TIMEOUT_S, check=True).stdout)
    if not stdlib_only:
        return _Interpreter(python, (*found["prefixes"], os.path.dirname(os.path.realpath(python))), ())
    executable = found["base_executable"]
    sites = [*found["sites"], *(path for pattern in _SITE_GLOBS for path in glob.glob(pattern))]
    hidden = dict.fromkeys(path for site in sites for path in (os.path.abspath(site), os.path.realpath(site))
                           if os.path.isdir(path))
    return _Interpreter(executable, (*found["bases"], os.path.dirname(os.path.realpath(executable))), tuple(hidden))


def python_dirs(python: str) -> tuple[str, ...]:
    """The directories ``python`` runs from: its prefixes (stdlib, site-packages) and its executable's."""
    return _interpreter(python, False).directories


def _executable(config: SandboxConfig) -> str:
    return _interpreter(config.python, True).executable if config.stdlib_only else config.python


def is_under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def ancestors(path: str) -> list[str]:
    """``/a/b/c`` -> ``["/a", "/a/b"]``."""
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _layout(config: SandboxConfig, workdir: str, empty: str) -> _Layout:
    read_only: list[tuple[str, str]] = [("/usr", "/usr")]
    symlinks = list(_DEV_LINKS)
    for top in TOP_DIRS:
        if os.path.islink(top):
            symlinks.append((os.readlink(top), top))
        elif os.path.isdir(top):
            read_only.append((top, top))
    if os.path.isfile("/etc/ld.so.cache"):
        read_only.append(("/etc/ld.so.cache", "/etc/ld.so.cache"))
    interpreter = _interpreter(config.python, config.stdlib_only)
    for directory in interpreter.directories:
        source = os.path.realpath(directory)
        for target in dict.fromkeys((os.path.abspath(directory), source)):
            taken = [bound for _, bound in read_only] + [link for _, link in symlinks]
            # "/": an interpreter installed at the root has its stdlib in /lib or /usr/lib
            if target != "/" and not any(is_under(target, other) for other in taken):
                read_only.append((source, target))
    hidden = tuple(path for path in interpreter.hidden if any(is_under(path, target) for _, target in read_only))
    return _Layout(tuple(read_only), tuple(symlinks), workdir, config.max_file_mb << 20, hidden, empty)


def host_tools(names: tuple[str, ...]) -> dict[str, str]:
    """Absolute paths of ``names`` on ``$PATH`` (plus the sbin directories); raises SandboxUnavailable if absent."""
    search_path = f"{os.environ.get('PATH', os.defpath)}{os.pathsep}{_SBIN}"
    found = {name: shutil.which(name, path=search_path) for name in names}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise SandboxUnavailable(f"{', '.join(missing)} not found on PATH")
    return found  # type: ignore[return-value]


def as_user(uid: int) -> list[str]:
    return [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


def _bwrap_argv(layout: _Layout, uid: int | None, command: list[str]) -> list[str]:
    tools = host_tools(("bwrap", "setpriv") if uid is not None else ("bwrap",))
    argv = [tools["bwrap"], "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent"]
    if uid is None:  # bwrap makes a user namespace, drops every capability and sets no_new_privs
        argv += ["--unshare-user", "--disable-userns"]
    else:  # root: no user namespace (it would map to root); setpriv switches to uid and drops the rest
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
        command = [tools["setpriv"], *as_user(uid), *DROP_PRIVILEGES, "--", *command]
    made = {"/", "/tmp"}

    def parents(path: str) -> list[str]:  # bwrap would make missing ones 0700, closed to the sandbox's uid
        missing = [parent for parent in ancestors(path) if parent not in made]
        made.update(missing)
        return [arg for parent in missing for arg in ("--perms", "0755", "--dir", parent)]

    # The private /tmp first: the interpreter's prefixes may live under the host's /tmp (a checkout there).
    argv += ["--perms", "1777", "--size", str(layout.tmp_bytes), "--tmpfs", "/tmp"]
    for source, target in layout.read_only:
        argv += [*parents(target), "--ro-bind", source, target]
    for hidden in layout.hidden:
        argv += ["--ro-bind", layout.empty, hidden]
    for device in _DEVICES:
        argv += [*parents(device), "--dev-bind", device, device]
    for target, link in layout.symlinks:
        argv += ["--symlink", target, link]
    argv += ["--proc", "/proc"]
    for name in _PROC_READ_ONLY:  # bwrap covers some of them itself
        argv += ["--ro-bind-try", f"/proc/{name}", f"/proc/{name}"]
    argv += [*parents(layout.workdir), "--bind", layout.workdir, layout.workdir, "--remount-ro", "/",
             "--chdir", layout.workdir, "--", *command]
    return argv


def _fstab_field(path: str) -> str:
    return path.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011").replace("\n", "\\012")


def _unshare_argv(layout: _Layout, uid: int | None, base: str, command: list[str]) -> list[str]:
    """util-linux: the mount points are made in a skeleton root under ``base``, the mounts by ``_UNSHARE_SETUP``."""
    tools = host_tools(("unshare", "sh", "mount", "umount", "pivot_root", "setpriv"))
    root, fstab = os.path.join(base, "root"), os.path.join(base, "fstab")
    for path in ("/proc", "/tmp", "/.old", *(target for _, target in layout.read_only)):
        os.makedirs(root + path, exist_ok=True)
    for source, target in layout.read_only:
        if not os.path.isdir(source):
            os.rmdir(root + target)
            open(root + target, "x").close()
    os.makedirs(root + "/dev", exist_ok=True)
    for device in _DEVICES:
        open(root + device, "x").close()
    for target, link in layout.symlinks:
        os.symlink(target, root + link)
    entries = [(root, root, "none", "bind")]
    # The private /tmp first: the interpreter's prefixes may live under the host's /tmp (a checkout there).
    entries.append(("tmpfs", root + "/tmp", "tmpfs", f"nosuid,nodev,mode=1777,size={layout.tmp_bytes}"))
    entries += [(source, root + target, "none", "bind,ro,nosuid,nodev" + (",X-mount.mkdir" if (
        target + "/").startswith("/tmp/") else "")) for source, target in layout.read_only]
    entries += [(layout.empty, root + hidden, "none", "bind,ro,nosuid,nodev") for hidden in layout.hidden]
    entries += [(device, root + device, "none", "bind") for device in _DEVICES]
    entries.append(("proc", root + "/proc", "proc", "nosuid,nodev,noexec"))
    entries += [(root + f"/proc/{name}", root + f"/proc/{name}", "none", "bind,ro,nosuid,nodev,noexec")
                for name in _PROC_READ_ONLY if os.path.exists(f"/proc/{name}")]
    entries.append((layout.workdir, root + layout.workdir, "none", "bind,nosuid,nodev,X-mount.mkdir"))
    with open(fstab, "w", encoding="utf-8") as handle:
        handle.writelines(f"{_fstab_field(source)} {_fstab_field(target)} {kind} {options} 0 0\n"
                          for source, target, kind, options in entries)
    namespaces = ["--mount", "--pid", "--fork", "--kill-child", "--net", "--ipc", "--uts", "--cgroup"]
    if uid is None:  # in its own user namespace, the sandbox may create no other (for root it would be global)
        namespaces = ["--user", "--map-root-user", *namespaces]
    script = _UNSHARE_SETUP.format(
        forbid_userns="echo 0 > /proc/sys/user/max_user_namespaces\n" if uid is None else "",
        **{name: shlex.quote(tools[name]) for name in ("mount", "umount", "pivot_root")},
    )
    drop = [tools["setpriv"], *(as_user(uid) if uid is not None else []), *DROP_PRIVILEGES, "--"]
    return [tools["unshare"], *namespaces, "--", tools["sh"], "-c", script, "agentrl-sandbox", root, fstab,
            layout.workdir, *drop, *command]


@functools.cache
def real_root() -> bool:
    """Whether this process is root of the initial user namespace (uid 0 in a user namespace is not the host's root,
    and may have no other uid to switch to)."""
    with open("/proc/self/uid_map", encoding="ascii") as handle:
        return os.geteuid() == 0 and handle.read().split() == ["0", "0", "4294967295"]


def _prepare(isolation: Isolation, config: SandboxConfig, base: str, command: list[str]) -> tuple[list[str], str]:
    """Make a run's working directory under ``base`` and wrap ``command`` in ``isolation``: (argv, workdir)."""
    workdir = os.path.join(base, "work")
    os.mkdir(workdir)
    if isolation == "audit":
        return command, workdir
    uid = random.choice(ROOT_UIDS) if real_root() else None
    if uid is not None:
        os.chown(workdir, uid, uid)
    empty = os.path.join(base, "empty")  # what hides a directory (stdlib_only)
    os.mkdir(empty)
    layout = _layout(config, workdir, empty)
    if isolation == "bwrap":
        return _bwrap_argv(layout, uid, command), workdir
    return _unshare_argv(layout, uid, base, command), workdir


def _environment(workdir: str) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1",
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
    }


_WORKING: set[tuple[str, str, bool, str]] = set()
"""(mechanism, python, stdlib_only, $PATH) that ran the probe; failures are not cached, so they are retried on the
next run."""


def _probe(isolation: Literal["bwrap", "unshare"], config: SandboxConfig) -> str | None:
    """Why ``isolation`` cannot run ``config.python`` here, or None where it can (found by running it)."""
    key = (isolation, config.python, config.stdlib_only, os.environ.get("PATH", os.defpath))
    if key in _WORKING:
        return None
    try:
        with tempfile.TemporaryDirectory(prefix="agentrl-sandbox-") as base:
            argv, workdir = _prepare(isolation, config, base, [_executable(config), "-I", "-c", "print('ok')"])
            probe = subprocess.run(argv, cwd=workdir, env=_environment(workdir), stdin=subprocess.DEVNULL,
                                   capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S)
    except (SandboxUnavailable, OSError, subprocess.SubprocessError) as exc:
        return f"{isolation}: {exc}"
    if probe.returncode != 0 or probe.stdout != "ok\n":
        detail = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
        return f"{isolation}: {detail}"
    _WORKING.add(key)
    return None


def select_isolation(config: SandboxConfig) -> Isolation:
    """The mechanism that runs code under ``config`` on this machine now.

    Raises:
        SandboxUnavailable: no namespace mechanism works and ``config.allow_unsandboxed`` is not set.
    """
    candidates: tuple[Literal["bwrap", "unshare"], ...] = (
        ("bwrap", "unshare") if config.isolation == "auto" else (config.isolation,)
    )
    reasons = []
    for mechanism in candidates:
        reason = _probe(mechanism, config)
        if reason is None:
            return mechanism
        reasons.append(reason)
    if config.allow_unsandboxed:
        return "audit"
    raise SandboxUnavailable(
        f"refusing to run code: this machine cannot sandbox it ({'; '.join(reasons)}). Install bubblewrap or allow "
        "unprivileged user namespaces, or start the server with --allow_unsandboxed to run code without isolation "
        "(audit hooks only)"
    )


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


def _read_status(fd: int) -> int | None:
    """The program's wait status as the supervisor reported it (None: the supervisor was killed first)."""
    os.set_blocking(fd, False)
    with contextlib.suppress(BlockingIOError):
        if report := os.read(fd, 64):
            return int(report)
    return None


async def run_python(code: str, config: SandboxConfig | None = None, pass_fds: tuple[int, ...] = ()) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh temporary directory under the limits of ``config``. The program
    inherits ``pass_fds`` under the same numbers (the caller keeps its own copies, and closes them).

    Raises:
        SandboxUnavailable: the code cannot be isolated here and ``config.allow_unsandboxed`` is not set.
    """
    config = config or SandboxConfig()
    isolation = select_isolation(config)
    byte_limit = config.max_output_chars * 4
    with tempfile.TemporaryDirectory(prefix="agentrl-sandbox-") as base:
        status_read, status_write = os.pipe()  # the supervisor writes the program's wait status here
        try:
            try:
                bootstrap = [
                    _executable(config), "-I", "-c", _BOOTSTRAP,
                    str(config.memory_mb << 20), str(config.cpu_seconds), str(config.max_file_mb << 20),
                    "0" if isolation == "audit" else str(config.max_processes),  # unsandboxed, it counts the host's
                    "1" if isolation == "audit" else "0", str(status_write),
                ]
                argv, workdir = _prepare(isolation, config, base, bootstrap)
                with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as handle:
                    handle.write(code)
                started = time.perf_counter()
                process = await asyncio.create_subprocess_exec(
                    *argv, cwd=workdir, env=_environment(workdir),
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                    start_new_session=True, pass_fds=(status_write, *pass_fds),
                )
            finally:
                os.close(status_write)
            exit_code, timed_out, out, err, overflow = await _supervise(process, config, byte_limit)
            status = _read_status(status_read)
        finally:
            os.close(status_read)
        elapsed = time.perf_counter() - started
    if status is not None:
        exit_code = os.waitstatus_to_exitcode(status)
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    truncated = overflow or len(stdout) + len(stderr) > config.max_output_chars
    stdout = stdout[: config.max_output_chars]
    stderr = stderr[: max(config.max_output_chars - len(stdout), 0)]
    cpu_limited = exit_code in (-signal.SIGXCPU, -signal.SIGKILL) and not timed_out and not overflow
    return SandboxResult(
        stdout=stdout, stderr=stderr, exit_code=exit_code, timed_out=timed_out, cpu_limited=cpu_limited,
        output_limited=overflow, truncated=truncated, elapsed_s=elapsed, isolation=isolation,
    )


async def _supervise(
    process: asyncio.subprocess.Process, config: SandboxConfig, byte_limit: int
) -> tuple[int, bool, bytearray, bytearray, bool]:
    """Collect the output of ``process`` until it ends, killing it on the wall-clock or output limit.

    Returns its exit code, whether it timed out, its stdout and stderr, and whether the output overflowed.
    """
    assert process.stdin is not None and process.stdout is not None and process.stderr is not None
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
            # unsandboxed, a process that escaped the group may still hold the pipes: stop waiting for them
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(finished, _KILL_GRACE_S)
        exit_code = await process.wait()
    finally:
        overflow_wait.cancel()
        if process.returncode is None:
            _kill_group(process)
            finished.cancel()
            await process.wait()
        process.stdin.close()  # only now: the supervisor reads its end of file as "the server is gone"
    return exit_code, timed_out, out, err, overflow.is_set()
