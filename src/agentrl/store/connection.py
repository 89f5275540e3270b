"""Connection strings: resolution (flag → ``$AGENTRL_DB`` → embedded server), database name, clients."""

from __future__ import annotations

import logging
import os

from pymongo import MongoClient
from pymongo.uri_parser import parse_uri

from agentrl.log import redact

DEFAULT_DATABASE = "agentrl"
ENV_VAR = "AGENTRL_DB"
DB_HELP = ("MongoDB connection string whose path is the run's database, e.g. mongodb://host:27017/my_run "
           "(default: $AGENTRL_DB, else the embedded database, started on demand)")
"""The help of every command's ``--db_connection_string``."""

logger = logging.getLogger(__name__)


def resolve_connection_string(value: str | None = None, *, database: str | None = None) -> str:
    """The connection string to use: ``value`` if given, else ``$AGENTRL_DB``, else the embedded server.

    The embedded server (``agentrl db start``) is started on demand. ``database`` replaces the path (the run
    name) when the chosen string has none.
    """
    uri = value or os.environ.get(ENV_VAR)
    if not uri:
        from agentrl.store.embedded import embedded_server

        server = embedded_server()
        if server.pid() is None:
            logger.info("no --db_connection_string or $%s: starting the embedded database in %s", ENV_VAR,
                        server.data_dir)
        uri = server.start()
    if database and not database_name(uri, default=""):
        uri = with_database(uri, database)
    return uri


def database_name(uri: str, default: str = DEFAULT_DATABASE) -> str:
    """The database (run) name: the path of the connection string."""
    return parse_uri(uri)["database"] or default


def with_database(uri: str, database: str) -> str:
    """``uri`` with its database path set to ``database`` (options kept)."""
    head, sep, query = uri.partition("?")
    scheme, _, rest = head.partition("://")
    hosts = rest.split("/", 1)[0]
    return f"{scheme}://{hosts}/{database}" + (f"?{query}" if sep else "")


def sync_client(uri: str, **kwargs) -> MongoClient:
    """A PyMongo client with UTC-aware dates; the connection string is never logged unredacted."""
    logger.debug("connecting to %s", redact(uri))
    return MongoClient(uri, tz_aware=True, **kwargs)
