"""The first process inside a contained agent's namespaces (:mod:`agentrl.autorl_bench.containment`): it relays the
grading API into the agent's network namespace, runs the agent's start script and stops it when told to.

``python -I -m agentrl.autorl_bench.launcher --control_fd FD [--relay PORT=SOCKET] [--grace_s S] -- COMMAND...``

- ``--relay``: listens on ``127.0.0.1:PORT`` (the namespace's own loopback) before the agent starts and forwards
  every connection to the grading server's Unix socket ``SOCKET`` (bound into the namespace), so that
  ``GRADING_SERVER_URL`` works as a plain HTTP URL while no other port of the machine can be reached.
- ``COMMAND`` runs in a session of its own; neither the control pipe nor the listening socket is inherited.
- ``--control_fd``: a pipe the orchestrator never writes to. Its end of file (the orchestrator closed it to stop
  the agent, or died) sends SIGTERM to the agent's process group, then SIGKILL ``--grace_s`` later.

The launcher exits with the agent's status (128 + N when signal N ended it); its exit ends the PID namespace, so
every process the agent left behind, ``setsid`` and double-forked ones included, dies with it. Standard library
only, as it runs before anything else.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import threading
import time


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.close()


async def _relay(listener: socket.socket, target: str) -> None:
    async def forward(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_unix_connection(target)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(_pipe(client_reader, server_writer), _pipe(server_reader, client_writer))
        for writer in (server_writer, client_writer):
            writer.close()

    server = await asyncio.start_server(forward, sock=listener)
    async with server:
        await server.serve_forever()


def _listen(port: int) -> socket.socket:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    return listener


def _stop_on_eof(control_fd: int, agent: subprocess.Popen, grace_s: float) -> None:
    with contextlib.suppress(OSError):
        while os.read(control_fd, 4096):
            pass
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(agent.pid, sig)
        deadline = time.monotonic() + wait_s
        while agent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentrl.autorl_bench.launcher")
    parser.add_argument("--control_fd", type=int, required=True)
    parser.add_argument("--relay", default=None, metavar="PORT=SOCKET")
    parser.add_argument("--grace_s", type=float, default=10.0)
    parser.add_argument("command", nargs="+")
    args = parser.parse_args(argv)
    if args.relay:
        port, _, target = args.relay.partition("=")
        listener = _listen(int(port))
        threading.Thread(target=asyncio.run, args=(_relay(listener, target),), daemon=True).start()
    agent = subprocess.Popen(args.command, start_new_session=True)
    threading.Thread(target=_stop_on_eof, args=(args.control_fd, agent, args.grace_s), daemon=True).start()
    code = agent.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    os._exit(main())  # at once: the relay's thread and connections end with the process, without teardown noise
