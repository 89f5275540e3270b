"""The ``agentrl engine`` HTTP server: SGLang's native endpoints plus ``/v1/chat/completions`` (FastAPI/uvicorn).

Endpoints and status codes mirror SGLang's ``python/sglang/srt/entrypoints/http_server.py`` (v0.5.x): a bad
request (validation error, unknown field, token id outside the vocabulary, over-long request) is a 400 with
``{"error": {"message": ...}}``; ``/update_weights_from_disk`` answers ``{success, message,
num_paused_requests}`` with 200 or 400, ``/load_lora_adapter`` and ``/unload_lora_adapter`` ``{success,
error_message, loaded_adapters}`` with 200 or 400; ``/health`` and ``/health_generate`` answer an empty 200 or 503.

With an API key (``--api_key`` or ``$AGENTRL_INFERENCE_API_KEY``, SGLang's ``--api-key``) every request but the health
checks must carry ``Authorization: Bearer KEY``, compared in constant time; others get a 401.

On SIGTERM/SIGINT the running generations are aborted at once (each request is answered with finish reason
``abort``, requests arriving later get 503), then uvicorn shuts down gracefully: the process exits within seconds
even with long generations in flight, with status 0.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from http import HTTPStatus
from types import FrameType
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentrl.inference.batching import EngineStopped
from agentrl.inference.engine import InferenceEngine
from agentrl.inference.engine_config import EngineConfig, EngineServerConfig
from agentrl.inference.protocol import (
    BadRequest,
    BeginWeightUpdateRequest,
    ChatCompletionRequest,
    DestroyWeightsUpdateGroupRequest,
    EndWeightUpdateRequest,
    GenerateRequest,
    GenerateResponse,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterRequest,
    MemoryOccupationRequest,
    ModelInfo,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromTensorRequest,
)
from agentrl.inference.registration import ServiceRegistration, check_database
from agentrl.listen import listening_socket
from agentrl.log import redact

logger = logging.getLogger(__name__)

FLUSH_MESSAGE = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
                 "requests, the operation will not be performed.)\n")


def error_response(status: int, message: str) -> JSONResponse:
    """SGLang's error body, with the OpenAI ``type``/``code`` keys so the ``openai`` client reads it too."""
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _validation_message(error: RequestValidationError) -> str:
    parts = []
    for item in error.errors():
        location = ".".join(str(p) for p in item.get("loc", ()) if p != "body")
        parts.append(f"{location or 'body'}: {item.get('msg')}")
    return "invalid request: " + "; ".join(parts)


def require_api_key(app: FastAPI, api_key: str) -> None:
    """Answer 401 to every request but the health checks (and CORS preflights) without ``Authorization: Bearer
    <api_key>``, as SGLang's ``add_api_key_middleware``."""
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def _authenticate(request: Request, call_next: Callable) -> Response:
        if request.method == "OPTIONS" or request.url.path.startswith("/health"):
            return await call_next(request)
        if not hmac.compare_digest(request.headers.get("authorization", "").encode(), expected):
            return error_response(HTTPStatus.UNAUTHORIZED, "Unauthorized: give the engine's API key as "
                                  "'Authorization: Bearer KEY' (clients read $AGENTRL_INFERENCE_API_KEY)")
        return await call_next(request)


def _lifespan(engine: InferenceEngine, registration: ServiceRegistration | None,
              on_ready: Callable[[], None] | None) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: the generation loop runs (and ``registration`` registers and heartbeats) while it lasts."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            if registration is not None:
                await registration.start(load_published=engine.weights.load_published)
            if on_ready is not None:
                on_ready()
            yield
        finally:
            if registration is not None:
                await registration.stop()
            await asyncio.to_thread(engine.stop)

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    """Every failure answers SGLang's error body: 400 for bad requests, 503 once stopped, 500 for a crash."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(HTTPStatus.BAD_REQUEST, _validation_message(error))

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, error: BadRequest) -> JSONResponse:
        return error_response(HTTPStatus.BAD_REQUEST, str(error))

    @app.exception_handler(EngineStopped)
    async def _stopped(request: Request, error: EngineStopped) -> JSONResponse:
        return error_response(HTTPStatus.SERVICE_UNAVAILABLE, str(error))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail))

    @app.exception_handler(Exception)
    async def _crash(request: Request, error: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path)
        return error_response(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(error).__name__}: {error}")


def _add_generation_routes(app: FastAPI, engine: InferenceEngine) -> None:
    """Health checks, model info, the load, ``/generate`` and ``/v1/chat/completions``."""

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.healthy else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        return Response(status_code=200 if await engine.health_generate() else 503)

    @app.get("/get_model_info")
    async def get_model_info() -> ModelInfo:
        return engine.model_info()

    @app.get("/v1/loads")
    async def loads() -> dict[str, Any]:
        return engine.loads_report()

    @app.post("/generate", response_model_exclude_none=True)
    async def generate(request: GenerateRequest) -> GenerateResponse:
        return await engine.generate(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest) -> JSONResponse:
        return JSONResponse(await engine.chat(request))


def _answer(result: BaseModel) -> JSONResponse:
    """SGLang's answer to an admin weight call: the result with 200 on ``success``, else 400."""
    return JSONResponse(result.model_dump(), status_code=200 if result.success else 400)  # type: ignore[attr-defined]


def _add_weight_routes(app: FastAPI, engine: InferenceEngine, registration: ServiceRegistration | None) -> None:
    """Weight updates from disk and over a weight-update group, and LoRA adapters (``{success, ...}`` with 200 or
    400)."""

    async def updated(result: BaseModel) -> JSONResponse:
        """The answer to a weight update; a successful one is heartbeated at once (the registry's version)."""
        if registration is not None and result.success:  # type: ignore[attr-defined]
            await registration.heartbeat()
        return _answer(result)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: UpdateWeightsFromDiskRequest) -> JSONResponse:
        return await updated(await engine.weights.update_weights_from_disk(request))

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: InitWeightsUpdateGroupRequest) -> JSONResponse:
        result = await engine.weights.init_weights_update_group(request)
        return _answer(result)

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: UpdateWeightsFromDistributedRequest) -> JSONResponse:
        return await updated(await engine.weights.update_weights_from_distributed(request))

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: UpdateWeightsFromTensorRequest) -> JSONResponse:
        return await updated(await engine.weights.update_weights_from_tensor(request))

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: BeginWeightUpdateRequest) -> JSONResponse:
        return _answer(await engine.weights.begin_weight_update(request))

    @app.post("/end_weight_update")
    async def end_weight_update(request: EndWeightUpdateRequest) -> JSONResponse:
        return _answer(await engine.weights.end_weight_update(request))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: DestroyWeightsUpdateGroupRequest) -> JSONResponse:
        result = await engine.weights.destroy_weights_update_group(request)
        return _answer(result)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> JSONResponse:
        result = await engine.adapters.load_lora_adapter(request)
        return _answer(result)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> JSONResponse:
        result = await engine.adapters.unload_lora_adapter(request)
        return _answer(result)


def _add_memory_routes(app: FastAPI, engine: InferenceEngine) -> None:
    """The prefix cache and the GPU memory (``/flush_cache``, ``/release_memory_occupation``, ``/resume_...``)."""

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        flushed = await engine.flush_cache()
        return Response(content=FLUSH_MESSAGE, status_code=200 if flushed else 400)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: MemoryOccupationRequest | None = None) -> Response:
        await engine.release_memory()
        return Response(status_code=200)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: MemoryOccupationRequest | None = None) -> Response:
        await engine.resume_memory()
        return Response(status_code=200)


def create_app(engine: InferenceEngine, registration: ServiceRegistration | None = None,
               on_ready: Callable[[], None] | None = None, api_key: str | None = None) -> FastAPI:
    """The FastAPI application serving ``engine``; the generation loop runs for the app's lifetime.

    With ``registration``, the engine registers itself on startup (loading the run's published weights before
    samplers may pick it), heartbeats, and is marked down on shutdown. With ``api_key``, every request but
    ``/health`` and ``/health_generate`` must carry ``Authorization: Bearer <api_key>`` (else 401), as SGLang's
    ``--api-key``.
    """
    app = FastAPI(title="agentrl engine", lifespan=_lifespan(engine, registration, on_ready))
    if api_key:
        require_api_key(app, api_key)
    _add_error_handlers(app)
    _add_generation_routes(app, engine)
    _add_weight_routes(app, engine, registration)
    _add_memory_routes(app, engine)
    return app


def advertised_url(host: str, port: int) -> str:
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    return f"http://{host}:{port}"


class EngineServer(uvicorn.Server):
    """uvicorn's server whose SIGTERM/SIGINT handling also aborts the engine's running generations, so the graceful
    shutdown that follows never waits for them."""

    def __init__(self, config: uvicorn.Config, engine: InferenceEngine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not serving yet or any more: nothing to abort
            return
        loop.call_soon_threadsafe(self.engine.abort_all)


def serve(engine_config: EngineConfig, server_config: EngineServerConfig) -> int:
    """Load the model, then serve until SIGINT/SIGTERM; print ``agentrl engine ready at URL`` once listening."""
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)  # transformers' per-start chatter
    try:
        sock = listening_socket(server_config.host, server_config.port)  # connections queue from now on
    except OSError as error:
        print(f"error: cannot listen on {server_config.host}:{server_config.port}: {error}", file=sys.stderr)
        return 1
    port = sock.getsockname()[1]
    url = server_config.advertise_url or advertised_url(server_config.host, port)
    if server_config.db_connection_string:
        try:
            asyncio.run(check_database(server_config.db_connection_string))
        except RuntimeError as error:
            sock.close()
            print(f"error: {error}", file=sys.stderr)
            return 1
    engine = InferenceEngine(engine_config)
    registration = None
    if server_config.db_connection_string:
        registration = ServiceRegistration(
            server_config.db_connection_string, url, kind="agentrl-engine", models=[engine.model_name],
            status=engine.load, weight_version=lambda: engine.weight_version,
            interval_s=server_config.heartbeat_interval_s)
        logger.info("registering in %s", redact(server_config.db_connection_string))

    def announce() -> None:
        threads = torch.get_num_threads()
        where = f"{engine.device}, {threads} thread{'s' * (threads != 1)}" if engine.device.type == "cpu" else \
            str(engine.device)
        print(f"agentrl engine ready at {url} serving {engine.model_name} ({where}, {engine.precision})", flush=True)

    app = create_app(engine, registration, on_ready=announce,
                     api_key=server_config.api_key.get_secret_value() if server_config.api_key else None)
    server = EngineServer(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=30), engine)
    # uvicorn turns SIGINT/SIGTERM into a graceful shutdown, then re-raises the signal with the handlers it found
    # installed; these make that re-raise a no-op, so a graceful stop exits with status 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if server.started else 1
