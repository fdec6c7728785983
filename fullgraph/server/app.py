"""The routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` as
server-sent events), ``GET /v1/models``, ``GET /health``, ``GET /metrics``.

Every error is OpenAI-shaped JSON (``protocol.ApiError``): 400 for a bad body or value, 401 for a
missing or wrong API key (compared in constant time; ``/health`` is open, everything else closed),
404 / 405 for an unknown route or method, 413 for a body over ``max_body_bytes``, 503 while the
model loads, 500 (a message, never a traceback) for a failure of ours. Bodies are parsed by
``protocol`` rather than by pydantic models, so messages name the field the way the engine does.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from . import protocol
from .config import ServerConfig
from .loop import ClientGone, now
from .protocol import ApiError
from .state import Disconnect, ServerState

logger = logging.getLogger("fullgraph.server")
_DRAIN_LIMIT = 256 * 2**20  # a body over the limit is read (and dropped) up to this, so the client gets its 413


def error_response(err: ApiError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


class ApiKeyGate:
    """ASGI middleware: every path but ``/health`` needs ``Authorization: Bearer <key>``."""

    OPEN = frozenset({"/health"})

    def __init__(self, app, key: str | None, metrics) -> None:
        self.app, self.metrics = app, metrics
        self._digest = hashlib.sha256(key.encode()).digest() if key else None

    async def __call__(self, scope, receive, send) -> None:
        if self._digest is None or scope["type"] != "http" or scope["path"] in self.OPEN:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self._digest):
            return await self.app(scope, receive, send)
        message = "missing API key (send Authorization: Bearer <key>)" if not given else "incorrect API key"
        self.metrics.http_errors.labels("401").inc()
        await error_response(ApiError(401, message, None, "invalid_api_key"),
                             {"WWW-Authenticate": "Bearer"})(scope, receive, send)


class EventStream(Response):
    """``text/event-stream`` from an async iterator of ready ``data: ...`` events; the iterator is
    closed (aborting its requests) however the stream ends."""

    media_type = "text/event-stream"

    def __init__(self, events, disconnect: Disconnect, abort) -> None:
        self.status_code, self.background = 200, None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # no body: no content-length
        self.events, self.disconnect, self.abort = events, disconnect, abort

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for data in self.events:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (OSError, ClientGone):
            pass  # the client left: the finally below aborts its requests
        finally:
            self.disconnect.close()
            await self.events.aclose()
            self.abort()  # also when the events never started (their own finally aborts otherwise)


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object: 413 above ``limit`` bytes, 400 if it is not a JSON object."""
    length = request.headers.get("content-length")
    if length is not None and not length.isdigit():
        raise protocol.bad(f"Content-Length: not a number ({length[:20]!r})")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif size > _DRAIN_LIMIT:
            break
    if size > limit:
        raise ApiError(413, f"the request body is {size if size <= _DRAIN_LIMIT else 'over %d' % size} bytes; this "
                            f"server takes at most {limit} (--max-body-bytes)", None, "request_too_large")
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as err:
        raise protocol.bad(f"the body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise protocol.bad(f"the body must be a JSON object, got {type(body).__name__}")
    return body


def build_app(config: ServerConfig, loader=None) -> FastAPI:
    """The ASGI app of one server: ``loader()`` returns the ``fg.LLM`` (default: ``load_llm(config)``),
    run in a background thread once the app starts; until it returns, requests get 503."""
    state = ServerState(config, loader)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        import asyncio

        state.start(asyncio.get_running_loop())
        yield
        state.close()

    app = FastAPI(title="fullgraph", summary="OpenAI-compatible API over one fullgraph engine", lifespan=lifespan)
    app.state.server = state
    _routes(app, state)
    _handlers(app, state)
    app.add_middleware(ApiKeyGate, key=config.api_key, metrics=state.metrics)
    return app


def _routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        state.require_ready()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        state.require_ready()
        info = state.info
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": state.created, "owned_by": "fullgraph",
             "max_model_len": info.max_model_len, "vocab_size": info.vocab_size, "tokenizer": state.served.has_tokenizer}
            for name in state.served.names]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, state, protocol.parse_completion)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _serve(request, state, protocol.parse_chat)


async def _serve(request: Request, state: ServerState, parse) -> Response:
    arrival = now()
    state.require_ready()
    job = parse(await read_json(request, state.config.max_body_bytes), state.served)
    disconnect = Disconnect(request.receive)
    try:
        prompts = await state.prompt_ids(job)
        sink = await state.submit(job, prompts, arrival)
    except BaseException:
        disconnect.close()
        raise
    disconnect.attach(sink)
    if job.stream:
        return EventStream(state.events(job, sink), disconnect, lambda: state.loop.abort(sink))
    try:
        return JSONResponse(await state.gather(job, sink))
    except ClientGone:
        return Response(status_code=499)  # nobody reads it
    finally:
        disconnect.close()


def _handlers(app: FastAPI, state: ServerState) -> None:
    def answer(err: ApiError) -> JSONResponse:
        state.metrics.http_errors.labels(str(err.status)).inc()
        return error_response(err)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError):
        return answer(err)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return answer(ApiError(err.status_code, message.get(err.status_code, str(err.detail))))

    @app.exception_handler(Exception)
    async def internal(request: Request, err: Exception):
        logger.exception("fullgraph: %s %s failed", request.method, request.url.path)
        return answer(ApiError(500, f"internal error: {type(err).__name__} (see the server's log)"))
