"""An OpenAI-compatible HTTP server over one ``fg.Engine`` (the optional extra ``serve``: FastAPI,
uvicorn, prometheus_client). ``python -m fullgraph serve --model PATH`` runs it.

Layout: ``protocol`` (request bodies onto SamplingParams, OpenAI-shaped errors; which fields are
ignored or refused), ``responses`` (bodies, stream chunks, logprobs), ``engine_process`` (the
engine in a process of its own, the default), ``loop`` (the engine on a thread of this process,
and the sinks both deliver into), ``state`` (loading, tokenizing, running a request), ``metrics``
(Prometheus), ``app`` (routes, API key, body limit), ``config`` (ServerConfig, loading the model).
"""
from __future__ import annotations

import importlib.util
import sys

from .config import ServerConfig, load_llm


def _require_extra() -> None:
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"the server needs {', '.join(missing)}: pip install 'fullgraph[serve]'")


def build_app(config: ServerConfig, loader=None):
    """The ASGI app (see ``app.build_app``)."""
    _require_extra()
    from .app import build_app as build

    return build(config, loader)


def serve(config: ServerConfig, *, log_level: str = "info", access_log: bool = True) -> int:
    """Listen on ``config.host:port`` at once, load the model in the background (503 until it is
    ready), serve until SIGINT / SIGTERM. A model that fails to load stops the server with a
    ``ValueError`` saying why."""
    _require_extra()
    import uvicorn

    from .app import build_app as build

    # With the engine on a thread (engine_process=False) it shares the GIL with the event loop: a
    # shorter switch interval (default 5 ms) lets it take the lock back soon after each device wait.
    sys.setswitchinterval(0.001)
    app = build(config)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                                           access_log=access_log, timeout_graceful_shutdown=5))
    state = app.state.server
    state.on_load_error = lambda message: setattr(server, "should_exit", True)
    server.run()
    if state.load_error is not None:
        raise ValueError(f"loading the model failed: {state.load_error}")
    return 0


__all__ = ["ServerConfig", "build_app", "load_llm", "serve"]
