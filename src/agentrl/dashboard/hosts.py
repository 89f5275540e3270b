"""The names a dashboard without a token answers to (against DNS rebinding).

A page of another site whose name a DNS rebinding points at 127.0.0.1 reaches the dashboard from the user's own
browser, but its requests carry that site's name in ``Host``. So a dashboard without a token answers only requests
naming it: its listen address, ``localhost``, ``127.0.0.1`` and ``::1`` when it listens on loopback, and the names
given with ``--allowed_hosts`` (a tunnel's or a proxy's). Ports are not compared: a tunnel may forward another port.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from agentrl.listen import is_loopback

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def normalize_host(name: str) -> str:
    """``name`` in lowercase, or an IP address in its short form (``0:0::1`` → ``::1``)."""
    try:
        return ipaddress.ip_address(name).compressed
    except ValueError:
        return name.lower()


def host_name(header: str | None) -> str | None:
    """The host a ``Host`` header names (``[::1]:8080`` → ``::1``); ``None`` when there is none or it is malformed."""
    if not header or any(c in header for c in "/?#@\\"):
        return None
    try:
        parts = urlsplit(f"//{header}")
        _ = parts.port  # a bad port raises ValueError
    except ValueError:
        return None
    return normalize_host(parts.hostname) if parts.hostname else None


def allowed_names(host: str, extra: str = "") -> frozenset[str]:
    """The names a dashboard listening on ``host`` answers to, plus ``extra`` (comma-separated host names or IP
    addresses); ``ValueError`` names an entry of ``extra`` that is neither."""
    bare = host.strip("[]")
    names = {normalize_host(bare), *(LOOPBACK_NAMES if is_loopback(bare) else ())}
    for entry in filter(None, (part.strip() for part in extra.split(","))):
        name = entry.strip("[]")
        if host_name(f"[{name}]" if ":" in name else name) != normalize_host(name):
            raise ValueError(f"--allowed_hosts: {entry!r} is not a host name or IP address (give it without scheme, "
                             "port or path)")
        names.add(normalize_host(name))
    return frozenset(names)
