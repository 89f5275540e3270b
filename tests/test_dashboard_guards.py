"""The dashboard's guards on a real `agentrl dashboard` process: without a token it answers only requests whose
``Host`` names it (a DNS-rebinding page sends its own name), and a token that is not ASCII is refused like any
wrong token (401), never a server error."""

from __future__ import annotations

import subprocess

import httpx
import pytest

from agentrl.dashboard.hosts import allowed_names
from test_dashboard import BIN, start_dashboard, stop


def status(url: str, path: str = "/api/runs", **kwargs) -> int:
    return httpx.get(url.rstrip("/") + path, timeout=30, **kwargs).status_code


def test_without_a_token_only_requests_naming_the_dashboard_are_answered(db_uri: str) -> None:
    process, url = start_dashboard(f"agentrl dashboard --db_connection_string {db_uri} --port 0")
    port = url.rstrip("/").rsplit(":", 1)[1]
    try:
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}", f"[::1]:{port}", "localhost",
                     "localhost:9000"):  # an SSH tunnel may forward another port
            assert status(url, headers={"Host": host}) == 200, host
        for host in (f"evil.example.com:{port}", "evil.example.com", f"127.0.0.1.nip.io:{port}",
                     f"localhost.evil.example.com:{port}", f"localhost@evil.example.com:{port}",
                     f"localhost:{port}/x", "[::2]", "localhost:port", ""):
            response = httpx.get(url + "api/runs", headers={"Host": host}, timeout=30)
            assert response.status_code == 403, host
            assert "--allowed_hosts" in response.json()["detail"], host
    finally:
        stop(process)


def test_allowed_hosts_adds_the_names_a_tunnel_or_proxy_uses(db_uri: str) -> None:
    process, url = start_dashboard(f"agentrl dashboard --db_connection_string {db_uri} --port 0 "
                                   "--allowed_hosts dash.example.org,[fd00::5]")
    try:
        for host in ("dash.example.org:8443", "DASH.example.org", "[fd00:0::5]:80", "localhost"):
            assert status(url, headers={"Host": host}) == 200, host
        assert status(url, headers={"Host": "evil.example.com"}) == 403
    finally:
        stop(process)


def test_allowed_hosts_must_be_names() -> None:
    assert allowed_names("127.0.0.1") == {"127.0.0.1", "localhost", "::1"}
    assert allowed_names("::1", "Dash.Example.org, 0:0::ab") == {"127.0.0.1", "localhost", "::1", "dash.example.org",
                                                                  "::ab"}
    assert allowed_names("10.1.2.3") == {"10.1.2.3"}
    for bad in ("http://dash.example.org", "dash.example.org:8443", "dash/x", "a@b"):
        with pytest.raises(ValueError, match="--allowed_hosts"):
            allowed_names("127.0.0.1", bad)
    refused = subprocess.run([str(BIN / "agentrl"), "dashboard", "--allowed_hosts", "https://dash.example.org",
                              "--port", "0"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "'https://dash.example.org' is not a host name" in refused.stderr


def test_a_token_that_is_not_ascii_is_refused_with_401(db_uri: str) -> None:
    process, url = start_dashboard(f"agentrl dashboard --db_connection_string {db_uri} --port 0 "
                                   "--auth_token_env DASH_TOKEN", env={"DASH_TOKEN": "s3cret-tökén"})
    try:
        assert status(url, "/api/runs?token=%C3%A9t%C3%A9") == 401
        assert status(url, "/api/runs?token=\u00e9t\u00e9") == 401
        assert status(url, "/api/runs?token=%FF%FE") == 401  # not even UTF-8
        assert status(url, headers={"Authorization": "Bearer \u00e9t\u00e9".encode()}) == 401
        assert status(url, headers={"Cookie": "agentrl_dashboard_token=\u00e9t\u00e9".encode()}) == 401
        assert status(url, "/api/runs?token=s3cret-t%C3%B6k%C3%A9n", follow_redirects=False) == 303
        with httpx.Client(base_url=url, timeout=30, follow_redirects=True) as browser:
            assert browser.get("/api/runs?token=s3cret-t%C3%B6k%C3%A9n").status_code == 200
            assert browser.get("/api/runs").status_code == 200  # the cookie it set
        assert status(url, headers={"Host": "evil.example.com"}) == 401  # with a token, the token is the guard
    finally:
        stop(process)
