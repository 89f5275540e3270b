"""Whether a MongoDB server answers (the embedded server's start-up wait, the dashboard's check, test fixtures)."""

from __future__ import annotations

from pymongo import MongoClient
from pymongo.errors import PyMongoError


def answers_ping(uri: str, timeout_s: float = 1.0) -> bool:
    """Whether the server of ``uri`` answers ``ping`` within ``timeout_s``."""
    client = MongoClient(uri, serverSelectionTimeoutMS=int(timeout_s * 1000), connectTimeoutMS=int(timeout_s * 1000))
    try:
        client.admin.command("ping")
        return True
    except PyMongoError:
        return False
    finally:
        client.close()
