"""`agentrl dashboard`: web pages and a JSON API over every run on a MongoDB server (read-only)."""

from __future__ import annotations

import argparse
import os
import sys

from agentrl.cli.options import add_db_option
from agentrl.dashboard.hosts import allowed_names
from agentrl.listen import is_loopback

READY_LINE = "dashboard: {url} (runs on {where})"


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "dashboard", help="web pages and a JSON API over every run on a MongoDB server, down to each token",
        description="Read-only web pages and a JSON API (/api, documented at /api/docs) over every AgentRL run on "
                    "a MongoDB server: runs, learning curves, record states, evaluations, each trajectory turn by "
                    "turn and token by token, each task's group side by side.")
    add_db_option(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: 127.0.0.1; any other needs --auth_token_env)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on, 0 for a free one (default: 8080)")
    parser.add_argument("--auth_token_env", default=None, metavar="VAR",
                        help="environment variable holding a token that every request must bring (header "
                             "'Authorization: Bearer TOKEN', or open a page once with ?token=TOKEN)")
    parser.add_argument("--allowed_hosts", default="", metavar="NAMES",
                        help="without --auth_token_env, only requests naming the dashboard in their Host header are "
                             "answered (against DNS rebinding): its address, and localhost, 127.0.0.1 and ::1 on "
                             "loopback; add the comma-separated names it is also served under (a tunnel's, a proxy's)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from agentrl.listen import listening_socket, serve_until_stopped
    from agentrl.log import redact
    from agentrl.store import database_name, resolve_connection_string, sync_client
    from agentrl.store.ping import answers_ping

    def fail(message: str) -> int:
        print(f"agentrl dashboard: error: {message}", file=sys.stderr)
        return 2

    token = None
    if args.auth_token_env:
        token = os.environ.get(args.auth_token_env, "")
        if not token:
            return fail(f"--auth_token_env {args.auth_token_env}: the environment variable is unset or empty")
    elif not is_loopback(args.host):
        return fail(f"--host {args.host} is reachable from other machines: give a token with --auth_token_env VAR "
                    "(or keep the default 127.0.0.1 and tunnel to it)")
    try:
        hosts = None if token else allowed_names(args.host, args.allowed_hosts)
    except ValueError as error:
        return fail(str(error))
    uri = resolve_connection_string(args.db_connection_string)
    where = redact(uri)
    if not answers_ping(uri, timeout_s=5.0):
        return fail(f"no MongoDB server answers at {where}")
    try:
        sock = listening_socket(args.host, args.port)
    except OSError as error:
        return fail(f"cannot listen on {args.host}:{args.port}: {error}")

    from agentrl.dashboard.app import create_app

    client = sync_client(uri, serverSelectionTimeoutMS=5000)
    app = create_app(client, default_database=database_name(uri, default="") or None, auth_token=token,
                     allowed_hosts=hosts)
    bound = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(READY_LINE.format(url=f"http://{host}:{bound}/", where=where), flush=True)
    # no access log: a first visit's URL carries ?token=
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5))
    try:
        started = serve_until_stopped(server, sock)
    finally:
        client.close()
    return 0 if started else 1
