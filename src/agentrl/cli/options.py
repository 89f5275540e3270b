"""Options shared by several sub-commands (defined once so their names and help stay identical)."""

from __future__ import annotations

import argparse


def add_db_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--db_connection_string", default=None, metavar="URI",
        help="MongoDB connection string whose path is the run's database, e.g. mongodb://host:27017/my_run "
             "(default: $AGENTRL_DB, else the embedded database, started on demand)")


def bool_flag(value: str) -> bool:
    """Parse ``true/false`` style flag values (the original AgentRL's scripts pass ``--flag true``)."""
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "y", "on"):
        return True
    if lowered in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
