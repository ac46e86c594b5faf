"""The starlette application: routes, CORS, request logging (no query strings: they may hold a token), and the
lifespan that loads the model on a thread (so /health answers at once) and stops the engine at the end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles

from server.auth import bearer_token
from server.http import openai_api
from server.http.openai_api import error_response
from server.metrics import CONTENT_TYPE
from server.runtime import Runtime
from server.ws.session import websocket_endpoint

log = logging.getLogger("voicelane.http")
DEMO_INDEX = Path(__file__).resolve().parent.parent / "client_demo" / "web" / "index.html"

FALLBACK_PAGE = """<!doctype html><meta charset="utf-8"><title>voicelane</title>
<style>body{font:15px/1.5 system-ui,sans-serif;max-width:46em;margin:3em auto;padding:0 1em}code{background:#eee;
padding:0 .3em}</style><h1>voicelane</h1><p>Real-time TTS server for Qwen3-TTS. Model: <b>%(model)s</b>%(random)s.</p>
<ul><li>WebSocket: <code>/v1/tts/ws</code> (protocol voicelane/1)</li>
<li>HTTP: <code>POST /v1/audio/speech</code>, <code>GET /v1/audio/voices</code>, <code>GET /v1/models</code></li>
<li><a href="/ready">/ready</a>, <a href="/health">/health</a>, <a href="/metrics">/metrics</a></li></ul>"""


async def index(request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    info = rt.info
    return HTMLResponse(FALLBACK_PAGE % {"model": info.name if info else "(loading)",
                                         "random": " (random weights: noise)" if info and info.random_weights else ""})


async def health(request: Request) -> Response:
    """Liveness: 200 while the process can serve or is still loading; 503 once the engine thread has died, so
    the liveness probe restarts the process (readiness alone would only take it out of rotation for ever)."""
    rt: Runtime = request.app.state.runtime
    dead = rt.engine is not None and not rt.engine_running()
    return JSONResponse({"status": "engine_stopped" if dead else "ok",
                         "uptime_s": round(time.time() - rt.started_at, 3), "model_loaded": rt.engine is not None,
                         "engine_running": rt.engine is not None and not dead, "draining": rt.draining},
                        status_code=503 if dead else 200)


async def ready(request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    r = rt.readiness()
    return JSONResponse(r, status_code=200 if r["ready"] else 503)


async def metrics(request: Request) -> Response:
    rt: Runtime = request.app.state.runtime
    if rt.metrics_keys.enabled and not rt.metrics_keys.check(bearer_token(request.headers)):
        return error_response("unauthorized", "/metrics needs the metrics key: Authorization: Bearer <metrics-key>")
    stats = rt.engine.stats() if rt.engine is not None else None
    info = rt.info
    labels = {"model": info.name if info else "", "random_weights": str(bool(info and info.random_weights)).lower()}
    return Response(rt.metrics.render(stats, labels, rt.readiness()), media_type=CONTENT_TYPE)


async def engine_trace(request: Request) -> Response:
    """The engine's recent timeline as a Chrome trace (chrome://tracing, Perfetto); guarded like /metrics."""
    rt: Runtime = request.app.state.runtime
    keys = rt.metrics_keys if rt.metrics_keys.enabled else rt.keys
    if keys.enabled and not keys.check(bearer_token(request.headers)):
        return error_response("unauthorized", "/debug/trace needs the metrics key (or an API key when none is set)")
    if rt.engine is None:
        return error_response("overloaded", "the model is still loading")
    return Response(rt.engine.chrome_trace(), media_type="application/json")


async def test_state(request: Request) -> Response:
    """Test hook (--enable-test-hooks only): what leak tests count, which /metrics does not show."""
    rt: Runtime = request.app.state.runtime
    return JSONResponse({"tasks": len(asyncio.all_tasks()), "sessions": len(rt.sessions),
                         "http_streams": rt.http_streams,
                         "engine": rt.engine.stats().to_json() if rt.engine is not None else None})


async def not_found(request: Request, exc) -> Response:
    return error_response("not_found", f"no route {request.url.path}")


async def method_not_allowed(request: Request, exc) -> Response:
    return JSONResponse({"error": {"message": f"{request.method} is not allowed on {request.url.path}",
                                   "type": "invalid_request_error", "param": None, "code": "method_not_allowed"}},
                        status_code=405)


async def server_error(request: Request, exc: Exception) -> Response:
    log.error("internal error serving %s %s", request.method, request.url.path, exc_info=exc)
    return error_response("internal", f"internal server error ({type(exc).__name__})")


class RequestLog:
    """One log line per HTTP request: method, path (never the query string), status, duration."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.monotonic()
        status = {"code": 0}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            path = scope.get("path", "")
            if path not in ("/health", "/ready", "/metrics"):
                client = scope.get("client") or ("-", 0)
                log.info('%s "%s %s" %s %.0f ms', client[0], scope.get("method"), path, status["code"],
                         (time.monotonic() - t0) * 1000)


def create_app(runtime: Runtime, loader: Callable[[], tuple] | None = None) -> Starlette:
    """`loader()` (optional) builds (engine, tokenizer) on a thread at start-up; without it the runtime must
    already hold an engine."""

    @asynccontextmanager
    async def lifespan(app):
        if loader is not None and runtime.engine is None:
            runtime.load_in_background(loader)
        try:
            yield
        finally:
            runtime.close()

    routes = [
        Route("/", index),
        Route("/health", health),
        Route("/ready", ready),
        Route("/metrics", metrics),
        Route("/debug/trace", engine_trace),
        Route("/v1/audio/speech", openai_api.speech, methods=["POST"]),
        Route("/v1/audio/voices", openai_api.voices),
        Route("/v1/models", openai_api.models),
        WebSocketRoute("/v1/tts/ws", websocket_endpoint),
    ]
    if runtime.config.test_hooks:
        routes.append(Route("/debug/test/state", test_state))
    if DEMO_INDEX.is_file():  # the browser demo (client_demo/web): index.html at / and its assets beside it
        async def demo_page(request: Request) -> Response:
            return FileResponse(DEMO_INDEX, headers={"cache-control": "no-cache"})

        routes[0] = Route("/", demo_page)
        routes.append(Mount("/", StaticFiles(directory=DEMO_INDEX.parent, html=False), name="demo"))
    middleware = [Middleware(RequestLog)]
    cors = runtime.origins.cors_origins()
    if cors:
        middleware.append(Middleware(CORSMiddleware, allow_origins=cors, allow_methods=["GET", "POST", "OPTIONS"],
                                     allow_headers=["authorization", "content-type"],
                                     expose_headers=["x-seed", "x-trace-id", "x-sample-rate", "x-codes-sha256",
                                                     "x-frames", "x-audio-ms", "x-finish-reason"]))
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={404: not_found, 405: method_not_allowed, Exception: server_error})
    app.state.runtime = runtime
    return app
