"""Containment of an AutoRL-Bench agent (``agentrl bench run``): bubblewrap namespaces that show the agent its
workspace, the software it trains with and the grading API, and nothing of the test data or the grading state.

**Files** (a mount namespace; the root is an empty tmpfs):

- read-only: ``/usr`` (and ``/bin``, ``/lib*``, ``/sbin`` or their links), ``/etc``, ``/sys``, the interpreter's
  prefixes (the virtual environment and its base Python), the AgentRL checkout the built-in agents live in, the
  agent's own directory, and the base model at the workspace's ``models/<name>`` (mounted; a read-only copy where
  the agent's uid could not read it);
- the workspace, writable, except for the files at its top (``instructions.md``, ``scenario.json``,
  ``run_meta.json``, ...), ``data/`` and ``models/<name>``, which are read-only; run as root, the agent's uid owns
  ``output/``, ``code/``, ``reports/`` and ``home/`` (``$HOME``) only, so it creates nothing else;
- a private ``/tmp``, a minimal ``/dev`` (null, zero, random, urandom, tty, shm; the GPUs' ``/dev/nvidia*``), a
  fresh ``/proc``;
- hidden (an empty tmpfs over a directory, ``/dev/null`` over a file) wherever they lie under a visible directory:
  ``masked`` paths, which the orchestrator fills with the benchmark's cache (built-in test sets), the results and
  grading-server state, the workspace root (other runs) and every scenario's test file.

**Processes**: new PID, IPC, UTS and cgroup namespaces: ``/proc`` lists the agent's own processes only (no other
process's command line, environment or file descriptors). No capabilities, ``no_new_privs``. Run as root, the
agent gets a random unprivileged uid of its own (as the tool sandbox's code, :mod:`agentrl.tools.sandbox`), which
owns its writable directories; otherwise it runs as your uid inside a user namespace, where the mounts above are
all it can reach. It may make namespaces of its own (AgentRL's Python tool sandbox needs them); their mounts stay
locked under these.

**Network**: ``isolated`` (default): a namespace with only a loopback; :mod:`agentrl.autorl_bench.launcher` relays
``127.0.0.1:PORT`` there to the grading server's Unix socket, so ``GRADING_SERVER_URL`` works and nothing else
can be reached: no port of this machine (the evaluation database's among them), nothing beyond. ``host``: the
machine's network, for agents that call remote APIs; then every service listening on this machine is reachable,
the evaluation database included.

**Fail closed**: :func:`check` runs bubblewrap once with this layout; where it cannot (not installed, user
namespaces forbidden), :class:`ContainmentUnavailable` says why and ``agentrl bench run`` refuses unless told to
run the agent uncontained.
"""

from __future__ import annotations

import functools
import glob
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from agentrl.tools.sandbox import (
    DROP_PRIVILEGES,
    ROOT_UIDS,
    TOP_DIRS,
    SandboxUnavailable,
    ancestors,
    as_user,
    host_tools,
    is_under,
    python_dirs,
    real_root,
)

Network = Literal["isolated", "host"]
WRITABLE = ("output", "code", "reports", "home")
"""The workspace's subdirectories the agent writes in."""
SOCKET_INSIDE = "/run/agentrl/grading.sock"
_PROBE_TIMEOUT_S = 60.0


class ContainmentUnavailable(RuntimeError):
    """The agent cannot be contained on this machine."""


def agent_uid() -> int | None:
    """The uid a contained agent runs as: a random unprivileged one when this process is the host's root, else
    ``None`` (your own uid, in a user namespace)."""
    return random.choice(ROOT_UIDS) if real_root() else None


@dataclass(frozen=True)
class AgentSandbox:
    """Where a contained agent runs and what it sees."""

    workspace: Path
    agent_dir: Path
    base_model: Path
    uid: int | None
    checkout: Path | None = None
    masked: tuple[Path, ...] = ()
    network: Network = "isolated"
    grading_socket: Path | None = None  # the grading server's Unix socket (isolated network)
    port: int = 5000  # where the launcher relays the grading API inside (isolated network)
    python: str = field(default_factory=lambda: sys.executable)

    @property
    def model_mount(self) -> Path:
        return self.workspace / "models" / self.base_model.name

    def prepare(self) -> None:
        """The host side: the base model's mount point (or, run as root with a model other users may not read, a
        read-only copy there), and the writable directories, handed to the agent's uid when run as root."""
        self.workspace.chmod(0o755)
        self.model_mount.mkdir(parents=True, exist_ok=True)
        if self.uid is not None and not _readable_by_all(self.base_model):
            shutil.copytree(self.base_model, self.model_mount, dirs_exist_ok=True)
            for path in (self.model_mount, *self.model_mount.rglob("*")):
                path.chmod(0o555 if path.is_dir() else 0o444)
        for name in WRITABLE:
            (self.workspace / name).mkdir(exist_ok=True)
            if self.uid is not None:
                os.chown(self.workspace / name, self.uid, self.uid)

    def argv(self, command: list[str], control_fd: int, grace_s: float) -> list[str]:
        """The bwrap command line that runs ``command`` (the agent's) under :mod:`agentrl.autorl_bench.launcher`."""
        launcher = [self.python, "-I", "-m", "agentrl.autorl_bench.launcher", "--control_fd", str(control_fd),
                    "--grace_s", str(grace_s)]
        if self.network == "isolated":
            if self.grading_socket is None:
                raise ValueError("an isolated network needs the grading server's Unix socket")
            launcher += ["--relay", f"{self.port}={SOCKET_INSIDE}"]
        return self._bwrap([*launcher, "--", *command])

    def _bwrap(self, command: list[str]) -> list[str]:
        tools = host_tools(("bwrap", "setpriv") if self.uid is not None else ("bwrap",))
        argv = [tools["bwrap"], "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                "--die-with-parent", "--new-session"]
        if self.network == "isolated":
            argv.append("--unshare-net")
        if self.uid is None:
            argv.append("--unshare-user")
        else:  # root: no user namespace (it would map to root); setpriv switches to the uid and drops the rest
            argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                     "--cap-add", "CAP_SETPCAP"]
            command = [tools["setpriv"], *as_user(self.uid), *DROP_PRIVILEGES, "--", *command]
        made = {"/", "/tmp"}

        def parents(path: str) -> list[str]:  # bwrap would make missing ones 0700, closed to the agent's uid
            missing = [parent for parent in ancestors(path) if parent not in made]
            made.update(missing)
            return [arg for parent in missing for arg in ("--perms", "0755", "--dir", parent)]

        # The private /tmp first: the checkout and the interpreter may live under the host's /tmp.
        argv += ["--tmpfs", "/tmp", "--dev", "/dev", "--proc", "/proc"]
        for device in sorted(glob.glob("/dev/nvidia*")):
            argv += ["--dev-bind-try", device, device]
        visible = self._visible()
        for source, target in visible:
            if os.path.islink(target) and target in TOP_DIRS:
                argv += ["--symlink", os.readlink(target), target]
            else:
                argv += [*parents(target), "--ro-bind", source, target]
        for path in map(str, self.masked):
            if os.path.exists(path) and any(is_under(path, target) for _, target in visible):
                argv += ["--tmpfs", path] if os.path.isdir(path) else ["--ro-bind", "/dev/null", path]
        # One writable mount (hard links between its directories work), with read-only ones over what the
        # orchestrator wrote: the files at its top and data/.
        workspace = str(self.workspace)
        argv += [*parents(workspace), "--bind", workspace, workspace]
        for path in sorted(self.workspace.iterdir()):
            if path.name == "data" or path.is_file():
                argv += ["--ro-bind", str(path), str(path)]
        if not any(self.model_mount.iterdir()):  # else prepare() copied it there
            argv += ["--ro-bind", str(self.base_model), str(self.model_mount)]
        if self.network == "isolated":
            argv += [*parents(SOCKET_INSIDE), "--bind", str(self.grading_socket), SOCKET_INSIDE]
        return [*argv, "--chdir", f"{workspace}/code", "--", *command]

    def _visible(self) -> list[tuple[str, str]]:
        """(host path, sandbox path) of everything bound read-only, outermost first; top-level symlinks as is."""
        roots = ["/usr", *(top for top in TOP_DIRS if os.path.lexists(top)), "/etc"]
        pairs = [(root, root) for root in roots]
        if os.path.isdir("/sys"):
            pairs.append(("/sys", "/sys"))
        extra = [*python_dirs(self.python), *([str(self.checkout)] if self.checkout else []), str(self.agent_dir)]
        for directory in extra:
            source = os.path.realpath(directory)
            for target in dict.fromkeys((os.path.abspath(directory), source)):
                taken = [bound for _, bound in pairs]
                if target != "/" and not any(is_under(target, other) for other in taken):
                    pairs.append((source, target))
        return pairs


def args_through_fd(argv: list[str]) -> tuple[list[str], int]:
    """The bwrap command line ``argv`` as ``[bwrap, "--args", FD, "--", COMMAND...]`` and the readable end FD of a
    pipe holding its options (the caller passes it to the child, then closes it), so that no process of the
    namespace shows the host paths of its mounts in its command line."""
    split = argv.index("--")
    data = b"".join(arg.encode() + b"\0" for arg in argv[1:split])
    if len(data) > 60000:  # what a pipe holds without a reader
        raise ValueError("the bwrap command line is too long")
    read, write = os.pipe()
    try:
        os.write(write, data)
    finally:
        os.close(write)
    return [argv[0], "--args", str(read), *argv[split:]], read


def _readable_by_all(directory: Path) -> bool:
    """Whether every file under ``directory`` is readable, and every directory searchable, by any user."""
    for path in (directory, *directory.rglob("*")):
        mode = path.stat().st_mode
        if mode & 0o004 == 0 or (stat.S_ISDIR(mode) and mode & 0o001 == 0):
            return False
    return True


@functools.cache
def _probe(python: str, network: Network) -> str | None:
    """Why an agent cannot be contained here (``None``: it can), found by running the interpreter contained."""
    with tempfile.TemporaryDirectory(prefix="agentrl-contain-") as base:
        workspace, model, agent, grading = (Path(base, name) for name in ("ws", "model", "agent", "grading.sock"))
        for directory in (workspace, model, agent):
            directory.mkdir()
        grading.touch()
        sandbox = AgentSandbox(workspace=workspace, agent_dir=agent, base_model=model, uid=agent_uid(),
                               network=network, grading_socket=grading, python=python)
        try:
            sandbox.prepare()
            argv = sandbox._bwrap([python, "-I", "-c", "print('ok')"])
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=_PROBE_TIMEOUT_S, env={"PATH": os.environ.get("PATH", os.defpath)})
        except (SandboxUnavailable, OSError, subprocess.SubprocessError) as error:
            return f"bwrap: {error}"
    if done.returncode != 0 or done.stdout != "ok\n":
        return "bwrap: " + (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return None


def check(network: Network = "isolated", python: str | None = None) -> None:
    """Raise :class:`ContainmentUnavailable` unless an agent can be contained here (a success is remembered)."""
    reason = _probe(python or sys.executable, network)
    if reason is not None:
        _probe.cache_clear()  # a failure is looked at again next time
        raise ContainmentUnavailable(
            f"refusing to run the agent: it cannot be contained on this machine ({reason}). Install bubblewrap "
            "(e.g. apt-get install bubblewrap) and allow unprivileged user namespaces, or pass --uncontained to run "
            "the agent as your own user, able to read the test data and the grading state")
