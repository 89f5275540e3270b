"""Options shared by several sub-commands (defined once so their names and help stay identical)."""

from __future__ import annotations

import argparse

from agentrl.store.connection import DB_HELP


def add_db_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db_connection_string", default=None, metavar="URI", help=DB_HELP)

