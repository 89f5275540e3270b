"""SGLangClient retries and errors, and the OpenAI pool's ordered fail-over.

Transient server failures (503 then success, slow answers) cannot be produced on demand by a real engine, so a
small scripted HTTP server (stdlib ``http.server`` on 127.0.0.1) plays that part; everything else runs against
real sockets and the real ``agentrl engine``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agentrl.inference import (
    AllModelsFailed,
    InferenceRequestError,
    InferenceServiceError,
    ModelEndpoint,
    OpenAIPool,
    SGLangClient,
)

OK_BODY = {"text": "hi", "output_ids": [5, 2], "meta_info": {
    "id": "x", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 3, "completion_tokens": 2,
    "weight_version": "4", "output_token_logprobs": [[-0.1, 5, None], [-0.2, 2, None]]}}


class ScriptedServer:
    """Answers each request with the next scripted ``(status, body, delay_s)``; the last one repeats."""

    def __init__(self, script: list[tuple[int, object, float]]):
        self.script, self.requests = list(script), []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                server.requests.append((self.command, self.path, self.rfile.read(length)))
                status, body, delay = server.script.pop(0) if len(server.script) > 1 else server.script[0]
                time.sleep(delay)
                data = json.dumps(body).encode() if not isinstance(body, bytes) else body
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def scripted() -> Iterator[list[ScriptedServer]]:
    servers: list[ScriptedServer] = []
    yield servers
    for server in servers:
        server.close()


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def fast_client(url: str, **kwargs) -> SGLangClient:
    return SGLangClient(url, backoff_s=0.01, max_backoff_s=0.05, **kwargs)


async def test_transient_failures_are_retried(scripted: list[ScriptedServer]) -> None:
    server = ScriptedServer([(503, {"error": {"message": "warming up"}}, 0), (502, "bad gateway", 0),
                             (200, OK_BODY, 0)])
    scripted.append(server)
    async with fast_client(server.url) as client:
        result = await client.generate([1, 2, 3], {"max_new_tokens": 2})
    assert len(server.requests) == 3
    assert (result.output_ids, result.output_token_logprobs, result.weight_version) == ([5, 2], [-0.1, -0.2], "4")
    sent = json.loads(server.requests[-1][2])
    # every sampling parameter is sent, defaults included: a server's preferred defaults must not apply
    assert sent == {"input_ids": [1, 2, 3], "return_logprob": True, "sampling_params": {
        "max_new_tokens": 2, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "repetition_penalty": 1.0, "ignore_eos": False, "skip_special_tokens": True,
        "no_stop_trim": False, "n": 1}}


async def test_persistent_failure_names_the_service(scripted: list[ScriptedServer]) -> None:
    server = ScriptedServer([(503, {"error": {"message": "overloaded"}}, 0)])
    scripted.append(server)
    async with fast_client(server.url, max_retries=2) as client:
        with pytest.raises(InferenceServiceError) as failure:
            await client.generate([1], {})
    assert len(server.requests) == 3
    error = failure.value
    assert error.transient and error.status_code == 503
    assert f"{server.url}/generate" in str(error) and "overloaded" in str(error)


async def test_bad_request_is_not_retried(scripted: list[ScriptedServer]) -> None:
    server = ScriptedServer([(400, {"error": {"message": "input_ids is empty"}}, 0)])
    scripted.append(server)
    async with fast_client(server.url) as client:
        with pytest.raises(InferenceRequestError, match="input_ids is empty"):
            await client.generate([1], {})
        with pytest.raises(InferenceRequestError, match="HTTP 400"):
            await client.update_weights_from_disk("/ckpt")
    assert len(server.requests) == 2


async def test_failed_weight_update_raises_its_message(scripted: list[ScriptedServer]) -> None:
    server = ScriptedServer([(400, {"success": False, "message": "shape mismatch", "num_paused_requests": 0}, 0)])
    scripted.append(server)
    async with fast_client(server.url) as client:
        with pytest.raises(InferenceRequestError, match="shape mismatch"):
            await client.update_weights_from_disk("/ckpt", weight_version=3)
    assert json.loads(server.requests[0][2]) == {"model_path": "/ckpt", "flush_cache": True, "weight_version": "3"}


async def test_generation_timeout_is_reported_not_repeated(scripted: list[ScriptedServer]) -> None:
    server = ScriptedServer([(200, OK_BODY, 1.5)])
    scripted.append(server)
    async with fast_client(server.url, timeout_s=0.3) as client:
        with pytest.raises(InferenceServiceError, match="timed out") as failure:
            await client.generate([1], {})
    assert failure.value.transient and len(server.requests) == 1


async def test_unreachable_service() -> None:
    url = closed_port_url()
    async with fast_client(url, max_retries=1) as client:
        assert not await client.health()
        with pytest.raises(InferenceServiceError, match="ConnectError") as failure:
            await client.generate([1], {})
    assert url in str(failure.value) and failure.value.transient


async def test_openai_pool_fails_over_in_order(engine_url: str, scripted: list[ScriptedServer]) -> None:
    broken = ScriptedServer([(500, {"error": {"message": "model crashed"}}, 0)])
    scripted.append(broken)
    endpoints = [
        {"model": "down", "base_url": f"{closed_port_url()}/v1", "api_key": "sk-secret-123"},
        {"model": "crashing", "base_url": f"{broken.url}/v1", "api_key": "sk-secret-456"},
        {"model": "tiny", "base_url": f"{engine_url}/v1"},
    ]
    async with OpenAIPool(endpoints, timeout_s=30, max_retries=0) as pool:
        text = await pool.chat_text([{"role": "user", "content": "Grade this."}], max_tokens=4, temperature=0)
        assert isinstance(text, str) and text
    assert len(broken.requests) == 1
    async with OpenAIPool(endpoints[:2], timeout_s=30, max_retries=0) as pool:
        with pytest.raises(AllModelsFailed) as failure:
            await pool.chat([{"role": "user", "content": "Grade this."}], max_tokens=4)
    assert [label.split(" at ")[0] for label, _ in failure.value.errors] == ["down", "crashing"]
    assert "model crashed" in str(failure.value) and "sk-secret" not in str(failure.value)


def test_model_endpoint_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JUDGE_KEY", raising=False)
    endpoint = ModelEndpoint(model="judge", base_url="http://127.0.0.1:1/v1", api_key_env="JUDGE_KEY")
    with pytest.raises(ValueError, match="JUDGE_KEY is not set"):
        endpoint.key()
    monkeypatch.setenv("JUDGE_KEY", "k-1")
    assert endpoint.key() == "k-1"
    assert ModelEndpoint(model="local", base_url="http://x/v1").key() == "EMPTY"
    assert "k-2" not in repr(ModelEndpoint(model="m", base_url="http://x/v1", api_key="k-2"))
    with pytest.raises(ValueError, match="not both"):
        ModelEndpoint(model="m", base_url="http://x/v1", api_key="a", api_key_env="B")
