"""`agentrl db start|stop|status`: the embedded MongoDB-protocol server (NX-27017) on 127.0.0.1."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("db", help="start, stop or inspect the embedded database")
    actions = parser.add_subparsers(dest="db_action", metavar="ACTION", required=True)
    for name, help_text in (("start", "start the server in the background and print its connection string"),
                            ("stop", "stop the server"), ("status", "say whether the server runs, and where")):
        action = actions.add_parser(name, help=help_text)
        action.add_argument("--data_dir", default=None,
                            help="where the server keeps its files (default: $AGENTRL_HOME/db or ~/.agentrl/db)")
        action.add_argument("--port", type=int, default=None,
                            help="port on 127.0.0.1 (default: the port last used with this data dir, else 27017; "
                                 "0: a free port)")
        action.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agentrl.store.embedded import EmbeddedDatabaseError, embedded_server

    server = embedded_server(args.data_dir, args.port)
    if args.db_action == "start":
        try:
            print(server.start())
        except EmbeddedDatabaseError as error:
            print(f"error: {error}")
            return 1
        return 0
    if args.db_action == "stop":
        stopped = server.stop()
        print("stopped" if stopped else f"not running (data dir {server.data_dir})")
        return 0
    pid = server.pid()
    if pid is None:
        print(f"not running (data dir {server.data_dir})")
        return 1
    print(f"running: pid {pid}, {server.uri()} (data dir {server.data_dir}, log {server.log_file})")
    return 0
