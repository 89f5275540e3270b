"""The dashboard's web app: HTML pages and the JSON API under ``/api`` they share (read-only: GET only).

Pages: ``/`` (runs), ``/runs/{run}`` (curves, states, reward per version, evaluations; live while the run runs),
``/runs/{run}/records`` (filterable, paginated), ``/runs/{run}/records/{id}`` (turns and token view) and
``/runs/{run}/tasks/{id}`` (the group side by side). The API answers 404 for unknown runs, records and tasks and
400 for bad filters. With an auth token, every request needs ``Authorization: Bearer TOKEN`` or the cookie that
opening any page with ``?token=TOKEN`` sets (401 otherwise). Without one, only requests whose ``Host`` names the
dashboard (``allowed_hosts``) are answered (403 otherwise): a page of another site that a DNS rebinding points at
127.0.0.1 sends its own name, and reads nothing.
"""

from __future__ import annotations

import hmac
import logging
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from pydantic import ValidationError
from pymongo import MongoClient

from agentrl.dashboard.charts import metric_charts
from agentrl.dashboard.hosts import host_name
from agentrl.dashboard.queries import RecordFilters, RunReader, UnknownItem
from agentrl.dashboard.tokens import TokenTexts, calls_views, image_runs, sample_view
from agentrl.trajectory.merge import PrefixError

logger = logging.getLogger(__name__)

HERE = Path(__file__).parent
TOKEN_COOKIE = "agentrl_dashboard_token"
LIVE_REFRESH_S = 5


class BadFilter(ValueError):
    """Query parameters that are not valid filters (HTTP 400)."""


def parse_filters(request: Request) -> RecordFilters:
    """The record filters of the request's query string; :class:`BadFilter` names each wrong parameter."""
    try:
        return RecordFilters.model_validate(dict(request.query_params))
    except ValidationError as error:
        problems = []
        for issue in error.errors():
            name = ".".join(str(part) for part in issue["loc"]) or "query"
            problems.append(f"{name}: {issue['msg'] if issue['type'] != 'extra_forbidden' else 'unknown filter'}")
        raise BadFilter("; ".join(problems)) from None


def _json(data: Any, status_code: int = 200) -> JSONResponse:
    return JSONResponse(jsonable_encoder(data), status_code=status_code)


def _token_matches(given: str, token: str) -> bool:
    """Constant-time comparison of UTF-8 bytes (``hmac.compare_digest`` refuses non-ASCII ``str``)."""
    return hmac.compare_digest(given.encode(), token.encode())


def _warm_tokenizers(reader: RunReader, texts: TokenTexts) -> None:
    try:
        for run in reader.run_names():
            texts.texts(reader.run_config(run).get("model_name_or_path"), [])
    except Exception:  # only a warm-up: the page loads what it needs itself
        logger.debug("warming the tokenizers failed", exc_info=True)


def _require_token(app: FastAPI, auth_token: str | None) -> None:
    """With ``auth_token``, a request needs ``Authorization: Bearer TOKEN`` or the cookie that ``?token=TOKEN`` sets
    (401 otherwise)."""

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if auth_token is None:
            return await call_next(request)
        offered = request.query_params.get("token")
        if offered is not None and _token_matches(offered, auth_token) and request.method == "GET":
            query = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "token"])
            response = RedirectResponse(request.url.path + (f"?{query}" if query else ""), status_code=303)
            response.set_cookie(TOKEN_COOKIE, auth_token, httponly=True, samesite="strict")
            return response
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else request.cookies.get(TOKEN_COOKIE, "")
        if not _token_matches(given, auth_token):
            return JSONResponse({"detail": "missing or wrong token: send 'Authorization: Bearer TOKEN' or open the "
                                           "page with ?token=TOKEN once"}, status_code=401)
        return await call_next(request)


def _require_host(app: FastAPI, allowed_hosts: frozenset[str] | None) -> None:
    """With ``allowed_hosts``, a request whose ``Host`` names none of them gets a 403."""

    @app.middleware("http")
    async def check_host(request: Request, call_next):
        if allowed_hosts is None or host_name(request.headers.get("host")) in allowed_hosts:
            return await call_next(request)
        return JSONResponse({"detail": f"this dashboard is not served under the name in the Host header "
                                       f"({request.headers.get('host', 'none')!r}); it answers to "
                                       f"{', '.join(sorted(allowed_hosts))} (add names with --allowed_hosts)"},
                            status_code=403)


def _add_error_pages(app: FastAPI, templates: Jinja2Templates) -> None:
    """Unknown runs, records and tasks answer 404, bad filters 400: JSON under ``/api/``, an error page elsewhere."""

    @app.exception_handler(UnknownItem)
    async def not_found(request: Request, error: UnknownItem) -> Response:
        if request.url.path.startswith("/api/"):
            return _json({"detail": str(error)}, 404)
        return templates.TemplateResponse(request, "error.html", {"message": str(error)}, status_code=404)

    @app.exception_handler(BadFilter)
    async def bad_filter(request: Request, error: BadFilter) -> Response:
        if request.url.path.startswith("/api/"):
            return _json({"detail": f"bad filter: {error}"}, 400)
        return templates.TemplateResponse(request, "error.html", {"message": f"bad filter: {error}"}, status_code=400)


def _add_api_routes(app: FastAPI, reader: RunReader) -> None:
    """The JSON API under ``/api``."""

    @app.get("/api/runs")
    def api_runs() -> JSONResponse:
        return _json({"runs": reader.runs()})

    @app.get("/api/runs/{run}")
    def api_run(run: str) -> JSONResponse:
        return _json(reader.run(run))

    @app.get("/api/runs/{run}/metrics")
    def api_metrics(run: str, split: str = "train") -> JSONResponse:
        return _json({"run": run, "split": split, "metrics": reader.metrics(run, split)})

    @app.get("/api/runs/{run}/records")
    def api_records(run: str, request: Request) -> JSONResponse:
        return _json(reader.records(run, parse_filters(request)))

    @app.get("/api/runs/{run}/records/{record_id:path}")
    def api_record(run: str, record_id: str) -> JSONResponse:
        return _json(reader.record(run, record_id))

    @app.get("/api/runs/{run}/tasks/{task_id:path}")
    def api_task(run: str, task_id: str) -> JSONResponse:
        return _json(reader.task(run, task_id))

    @app.get("/api/runs/{run}/images/{sha256}")
    def api_image(run: str, sha256: str) -> Response:
        """An image's bytes, as stored (checked against its hash; the type is the one PIL decoded, never the
        stored metadata's), cacheable for good: its URL is its content."""
        image = reader.image(run, sha256)
        return Response(image.data, media_type=image.mime_type, headers={
            "Cache-Control": "private, max-age=31536000, immutable", "X-Content-Type-Options": "nosniff"})


def _token_views(reader: RunReader, texts: TokenTexts, run: str,
                 record: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """The token views of ``record`` (its training samples, else its LLM calls) with each token's text, and why
    there are none when its calls do not fit together."""
    model = (reader.run_config(run) or {}).get("model_name_or_path")
    token_error = None
    try:
        views = [sample_view(s) for s in record["samples"]] or calls_views(record["calls"])
    except PrefixError as error:
        views, token_error = [], f"the LLM calls do not fit together: {error}"
    for view in views:
        view["texts"] = texts.texts(model, view["ids"])
        view["image_runs"] = image_runs(view, run)
    return views, token_error


def _add_pages(app: FastAPI, reader: RunReader, texts: TokenTexts, templates: Jinja2Templates) -> None:
    """The HTML pages: runs, a run, its records, a record, a task's group."""

    @app.get("/", response_class=HTMLResponse)
    def runs_page(request: Request) -> Response:
        return templates.TemplateResponse(request, "runs.html", {"runs": reader.runs()})

    @app.get("/runs/{run}", response_class=HTMLResponse)
    def run_page(request: Request, run: str) -> Response:
        info = reader.run(run)
        charts = metric_charts(reader.metrics(run))
        return templates.TemplateResponse(request, "run.html", {"run": run, "info": info, "charts": charts,
                                                                "live": info.get("status") == "running"})

    @app.get("/runs/{run}/records", response_class=HTMLResponse)
    def records_page(request: Request, run: str) -> Response:
        filters = parse_filters(request)
        page = reader.records(run, filters)
        return templates.TemplateResponse(request, "records.html", {
            "run": run, "page": page, "filters": filters, "choices": reader.filter_choices(run)})

    @app.get("/runs/{run}/records/{record_id:path}", response_class=HTMLResponse)
    def record_page(request: Request, run: str, record_id: str) -> Response:
        record = reader.record(run, record_id)
        views, token_error = _token_views(reader, texts, run, record)
        return templates.TemplateResponse(request, "record.html", {"run": run, "record": record, "views": views,
                                                                   "token_error": token_error})

    @app.get("/runs/{run}/tasks/{task_id:path}", response_class=HTMLResponse)
    def task_page(request: Request, run: str, task_id: str) -> Response:
        return templates.TemplateResponse(request, "task.html", {"run": run, "task": reader.task(run, task_id)})


def create_app(client: MongoClient, *, default_database: str | None = None, auth_token: str | None = None,
               allowed_hosts: frozenset[str] | None = None) -> FastAPI:
    """The dashboard over the runs ``client`` sees (``default_database``: the one to show when the user may not list
    databases). ``allowed_hosts``: the names a request's ``Host`` must give (``agentrl.dashboard.hosts``); ``None``
    accepts any (only safe with ``auth_token``)."""
    reader = RunReader(client, default_database)
    texts = TokenTexts()
    # the first record page of a run would wait seconds for transformers and the tokenizer: load them now
    threading.Thread(target=_warm_tokenizers, args=(reader, texts), daemon=True, name="warm-tokenizers").start()
    templates = Jinja2Templates(directory=HERE / "templates")
    templates.env.globals.update(urlencode=urlencode, live_refresh_s=LIVE_REFRESH_S)
    app = FastAPI(title="AgentRL dashboard", docs_url="/api/docs", openapi_url="/api/openapi.json", redoc_url=None)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    _require_token(app, auth_token)
    _require_host(app, allowed_hosts)
    _add_error_pages(app, templates)
    _add_api_routes(app, reader)
    _add_pages(app, reader, texts, templates)
    return app
