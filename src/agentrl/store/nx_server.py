"""The embedded server's process: NX-27017, with the dates that updates write stored as dates.

NX-27017 keeps documents in SQLite through neosqlite, which stores a date as ``{"$date": ISO}`` when it inserts or
replaces a document, but applies field updates (``$set``, ``$min``, ``$max``, ``$addToSet``, ...) in SQL, passing
each value as a parameter (``json_set(data, path, ?)``): a datetime becomes SQLite text there, and the field reads
back as a string (Compass's date filters then match nothing, and a sort puts every string before every date).
``keep_update_dates`` makes that SQL step receive a datetime as the same ``{"$date": ISO}`` object an insert
stores: neosqlite embeds objects as JSON, and the updates whose SQL cannot take one (``$min``, ``$max``) fall back
to its Python path, which keeps dates too. ``tests/test_store_dates.py`` checks these update forms on the server.
Not covered: ``$push`` of a document or a date, which NX-27017 stores as a JSON string (the store pushes only
strings and numbers).

Run as ``python -m agentrl.store.nx_server`` with NX-27017's own arguments (``agentrl.store.embedded`` does).
"""

from __future__ import annotations

import logging
import sys
from datetime import datetime
from typing import Any

from nx_27017.nx_27017 import main as nx_main

logger = logging.getLogger(__name__)


def keep_update_dates() -> None:
    """Make neosqlite's SQL updates store datetimes as dates (only a warning if this neosqlite version has no such
    step to hook, so that the server still starts)."""
    try:
        from neosqlite.collection.json_helpers import NeoSQLiteJSONEncoder
        from neosqlite.collection.query_helper import _sql_updates

        convert = _sql_updates._convert_bytes_to_binary
    except (ImportError, AttributeError) as error:
        logger.warning("dates written by updates may be stored as strings: this neosqlite version has no "
                       "update-value conversion to hook (%s)", error)
        return
    as_stored = NeoSQLiteJSONEncoder().default

    def convert_keeping_dates(value: Any) -> Any:
        return as_stored(value) if isinstance(value, datetime) else convert(value)

    _sql_updates._convert_bytes_to_binary = convert_keeping_dates


def main() -> None:
    keep_update_dates()
    sys.exit(nx_main())


if __name__ == "__main__":
    main()
