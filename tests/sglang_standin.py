"""A stand-in for a real SGLang server (not our engine): SGLang's HTTP behaviour, no model.

It serves the routes AgentRL uses with the shapes and semantics pinned in ``tests/contracts/sglang_api.json``
(SGLang 0.5.23), in particular the two that our own engine would hide:

* a ``sampling_params`` key SGLang does not know is a 400 (its ``api/v1`` contract gate); every parameter a request
  *omits* is taken from the server's preferred sampling params (``{**preferred_sampling_params,
  **obj.sampling_params}`` in ``tokenizer_manager.py``), else from SGLang's ``SamplingParams`` defaults;
* ``meta_info.weight_version`` is ``"default"`` until ``/update_weights_from_disk`` names a version.

Generation is a fixed rule: the reply is ``--reply_ids`` (its last id plays the EOS: finish reason ``stop``), cut at
``max_new_tokens`` (``length``); ``text`` is ``--reply_text`` for a whole reply. Every token's logprob is
``-1 / temperature`` of the temperature actually used, so stored logprobs show it too. ``GET /debug/requests``
(the stand-in's own, not SGLang's) lists every request body with the sampling params it ran with.

Run: ``python tests/sglang_standin.py --reply_ids 1,2,3 --reply_text TEXT [--preferred_sampling_params JSON]``;
it prints ``sglang stand-in ready at URL`` (``--port 0``, the default, picks a free port).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

CONTRACT = json.loads((Path(__file__).parent / "contracts" / "sglang_api.json").read_text())
READY = re.compile(r"sglang stand-in ready at (http://\S+)")
# Parameters whose value the stand-in reports as used (SGLang's defaults; top_k -1 is its "all" on the wire).
REPORTED = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty")
FLUSH_MESSAGE = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
                 "requests, the operation will not be performed.)\n")


def sglang_defaults() -> dict[str, Any]:
    defaults = {key: CONTRACT["sampling_params"]["defaults"][key] for key in REPORTED}
    defaults["top_k"] = -1  # TOP_K_ALL
    return defaults


class StandInSettings(BaseModel):
    reply_ids: list[int] = Field(min_length=1)
    reply_text: str = ""
    preferred_sampling_params: dict[str, Any] | None = None
    model_path: str = "Qwen/Qwen3-0.6B"
    abort_first: int = Field(0, ge=0, description="answer this many /generate requests as aborted (as SGLang does "
                             "on /abort_request or a shutdown), with the first token generated so far")


def create_app(settings: StandInSettings) -> FastAPI:
    """The stand-in's FastAPI application (its routes are checked against SGLang's in the contract tests)."""
    app = FastAPI(title="sglang stand-in")
    state: dict[str, Any] = {"weight_version": CONTRACT["weight_version_default"], "requests": []}
    accepted = set(CONTRACT["api_v1"]["SamplingParams"]["fields"])

    def error(message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "code": 400}}, status_code=400)

    async def body_of(request: Request) -> dict[str, Any]:
        raw = await request.body()
        return json.loads(raw) if raw else {}

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> JSONResponse:
        body = await body_of(request)
        sent = body.get("sampling_params") or {}
        unknown = sorted(set(sent) - accepted)
        if unknown:
            return error(f"unknown field `{unknown[0]}`, expected one of {', '.join(sorted(accepted))}")
        if not body.get("input_ids"):
            return error("the stand-in takes input_ids only")
        used = {**sglang_defaults(), **(settings.preferred_sampling_params or {}), **sent}
        state["requests"].append({"path": "/generate", "body": body,
                                  "sampling_params_used": {key: used[key] for key in REPORTED}})
        limit = int(used["max_new_tokens"])
        output_ids = settings.reply_ids[:limit]
        whole = len(output_ids) == len(settings.reply_ids)
        finish = {"type": "stop", "matched": output_ids[-1]} if whole else {"type": "length", "length": limit}
        if sum(r["path"] == "/generate" for r in state["requests"]) <= settings.abort_first:
            output_ids, whole = output_ids[:1], False
            finish = {"type": "abort", "message": "Abort request", "status_code": 200}
        temperature = float(used["temperature"]) or 1.0  # SGLang runs greedy requests at temperature 1, top_k 1
        meta: dict[str, Any] = {
            "id": body.get("rid") or uuid.uuid4().hex, "finish_reason": finish,
            "prompt_tokens": len(body["input_ids"]), "weight_version": state["weight_version"], "num_retractions": 0,
            "reasoning_tokens": 0, "completion_tokens": len(output_ids), "cached_tokens": 0, "e2e_latency": 0.001}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-1.0 / temperature, token, None] for token in output_ids]
            meta["output_token_logprobs_length"] = len(output_ids)
        return JSONResponse({"text": settings.reply_text if whole else "", "output_ids": output_ids,
                             "meta_info": meta})

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {"model_path": settings.model_path, "served_model_name": settings.model_path,
                "tokenizer_path": settings.model_path, "is_generation": True,
                "preferred_sampling_params": settings.preferred_sampling_params,
                "weight_version": state["weight_version"], "load_format": "auto", "reasoning_parser": None,
                "tool_call_parser": None, "disaggregation_mode": "null", "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await body_of(request)
        state["requests"].append({"path": "/update_weights_from_disk", "body": body})
        if not body.get("model_path"):
            return JSONResponse({"success": False, "message": "model_path is required", "num_paused_requests": 0},
                                status_code=400)
        message = "Succeeded to update model weights."
        if body.get("weight_version") is not None:
            state["weight_version"] = str(body["weight_version"])
            message += f" Weight version updated to {state['weight_version']}."
        return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        return Response(content=FLUSH_MESSAGE, status_code=200)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def memory_occupation(request: Request) -> Response:
        state["requests"].append({"path": request.url.path, "body": await body_of(request)})
        return Response(status_code=200)

    @app.get("/debug/requests")
    async def debug_requests() -> list[dict[str, Any]]:
        return state["requests"]

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(description="SGLang stand-in (tests only)")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--reply_ids", required=True, help="comma-separated token ids of every reply")
    parser.add_argument("--reply_text", default="")
    parser.add_argument("--preferred_sampling_params", default=None, metavar="JSON")
    parser.add_argument("--abort_first", type=int, default=0)
    args = parser.parse_args(argv)
    settings = StandInSettings(
        reply_ids=[int(i) for i in args.reply_ids.split(",")], reply_text=args.reply_text,
        preferred_sampling_params=json.loads(args.preferred_sampling_params) if args.preferred_sampling_params
        else None, abort_first=args.abort_first)
    sock = socket.socket()
    sock.bind(("127.0.0.1", args.port))
    sock.listen(128)
    server = uvicorn.Server(uvicorn.Config(create_app(settings), log_level="warning"))
    print(f"sglang stand-in ready at http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    asyncio.run(server.serve(sockets=[sock]))
    return 0


class StandInProcess:
    """``tests/sglang_standin.py`` as a subprocess; ``url`` once it serves. Stop it with :meth:`stop` (by PID)."""

    def __init__(self, reply_ids: list[int], reply_text: str = "",
                 preferred_sampling_params: dict[str, Any] | None = None, startup_timeout_s: float = 60.0,
                 abort_first: int = 0):
        command = [sys.executable, __file__, "--reply_ids", ",".join(map(str, reply_ids)), "--reply_text", reply_text,
                   "--abort_first", str(abort_first)]
        if preferred_sampling_params is not None:
            command += ["--preferred_sampling_params", json.dumps(preferred_sampling_params)]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.url = ""
        self.lines: list[str] = []
        ready = threading.Event()

        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                self.lines.append(line)
                match = READY.search(line)
                if match and not self.url:
                    self.url = match.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(startup_timeout_s)
        if not self.url:
            self.stop()
            raise RuntimeError("the SGLang stand-in did not start:\n" + "".join(self.lines))

    def requests(self, path: str = "/generate") -> list[dict[str, Any]]:
        """What the stand-in received on ``path`` (``/debug/requests``)."""
        import httpx

        return [r for r in httpx.get(f"{self.url}/debug/requests", timeout=10).json() if r["path"] == path]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def __enter__(self) -> StandInProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())
