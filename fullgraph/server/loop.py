"""The engine on a thread of the server's process (``ServerConfig(engine_process=False)``; the
default runs it in a process of its own, ``engine_process.py``, which delivers into the same
``Sink``s). Every call into ``fg.Engine`` (add_request, abort, step) happens on that thread.

HTTP handlers run on the asyncio event loop; they only enqueue commands (a thread-safe queue) and
await. The thread applies every queued command between two steps, runs a step while the engine
has work, and sleeps on the queue when it has none (no spinning). It hands each step's outputs to
the event loop in one ``call_soon_threadsafe`` call; there each lands in its HTTP request's
``Sink``, which the handler drains (several steps at once when it reads slower than the engine
steps). An accepted request group is answered through an asyncio future, so a request the engine
refuses (its ``ValueError`` names the field) comes back to the handler before any streaming starts.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..engine import Engine, RequestOutput, SamplingParams
from .metrics import ServerMetrics

logger = logging.getLogger("fullgraph.server")
_STOP = object()


class EngineFailed(Exception):
    """The engine failed (or the server stops) while this request ran; the message says why."""


class ClientGone(Exception):
    """The client disconnected."""


@dataclass(frozen=True)
class Snapshot:
    """The engine's state after the thread's last turn (read by /metrics from any thread)."""

    running: int = 0
    waiting: int = 0
    pages_in_use: int = 0
    pages_total: int = 0


class Sink:
    """Where one HTTP request's engine outputs land, on the event loop: ``(choice, output)`` pairs."""

    def __init__(self, ids: Sequence[str]) -> None:
        self.ids = list(ids)
        self.unfinished = len(self.ids)
        self._items: list[tuple[int, RequestOutput]] = []
        self._waiter: asyncio.Future | None = None
        self._error: Exception | None = None

    def push(self, k: int, out: RequestOutput) -> None:
        self._items.append((k, out))
        self.unfinished -= out.finished
        self._wake()

    def fail(self, error: Exception) -> None:
        if self._error is None:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self) -> list[tuple[int, RequestOutput]]:
        """Every output that arrived since the last call (waits for one); raises the failure."""
        while not self._items and self._error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        if self._error is not None:
            raise self._error
        items, self._items = self._items, []
        return items


class EngineLoop:
    """The engine thread over ``engine`` (see the module docstring); ``aloop`` is the event loop
    the handlers run on."""

    def __init__(self, engine: Engine, aloop: asyncio.AbstractEventLoop, metrics: ServerMetrics | None = None) -> None:
        self.engine, self._aloop, self._metrics = engine, aloop, metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, tuple[Sink, int, float]] = {}   # engine request id -> (sink, choice, arrival)
        self.snapshot = Snapshot(pages_total=engine.runner.config.num_blocks - 1)
        self._thread = threading.Thread(target=self._run, name="fullgraph-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Fail what still runs (503) and end the thread."""
        self._commands.put(_STOP)
        self._thread.join(timeout)

    # ---- the event loop's side ---------------------------------------------------------------
    async def submit(self, items: Sequence[tuple[str, list[int], SamplingParams]], arrival: float) -> Sink:
        """Queue ``(request id, prompt ids, params)`` as one group: all accepted, or a ``ValueError``
        (none queued)."""
        sink = Sink([rid for rid, _, _ in items])
        accepted = self._aloop.create_future()
        self._commands.put(("add", sink, list(items), accepted, arrival))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(sink)
            raise
        return sink

    def abort(self, sink: Sink) -> None:
        """Stop ``sink``'s unfinished requests and free their pages (thread-safe, idempotent)."""
        if sink.unfinished:
            self._commands.put(("abort", sink.ids))

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                commands = [self._commands.get()] if not self.engine.has_unfinished() else []
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                for command in commands:
                    if command is _STOP:
                        self._fail_all(EngineFailed("the server is shutting down"))
                        return
                    self._apply(command)
                if self.engine.has_unfinished():
                    self._step()
                self._publish()
        except BaseException as err:  # noqa: BLE001 (the thread must not die silently)
            logger.exception("fullgraph: the engine thread stopped")
            self._fail_all(EngineFailed(f"the engine thread stopped: {type(err).__name__}: {err}"))

    def _apply(self, command: tuple) -> None:
        if command[0] == "abort":
            for rid in command[1]:
                if self._live.pop(rid, None) is not None:
                    self.engine.abort(rid)
                    if self._metrics is not None:
                        self._metrics.finished.labels("abort").inc()
            return
        _, sink, items, accepted, arrival = command
        if accepted.cancelled():  # the client left before it was queued
            return
        added = []
        try:
            for rid, prompt, params in items:
                self.engine.add_request(rid, prompt, params)
                added.append(rid)
        except Exception as err:  # noqa: BLE001 (a ValueError is the client's; anything else is reported as ours)
            for rid in added:
                self.engine.abort(rid)
            if not isinstance(err, ValueError):
                logger.exception("fullgraph: add_request failed")
                err = EngineFailed(f"could not queue the request: {type(err).__name__}: {err}")
            self._post(_settle, accepted, err)
            return
        for k, rid in enumerate(added):
            self._live[rid] = (sink, k, arrival)
        if self._metrics is not None:
            self._metrics.prompt_tokens.inc(sum(len(p) for _, p, _ in items))
        self._post(_settle, accepted, None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as err:  # noqa: BLE001 (fail these requests, keep serving)
            logger.exception("fullgraph: an engine step failed")
            self._fail_all(EngineFailed(f"the engine step failed: {type(err).__name__}: {err}"))
            return
        batch = []
        for out in outputs:
            entry = self._live.get(out.request_id)
            if entry is None:
                continue  # aborted meanwhile
            batch.append((entry[0], entry[1], out))
            if out.finished:
                del self._live[out.request_id]
                if self._metrics is not None:
                    self._metrics.request_finished(out, entry[2])
        if self._metrics is not None and outputs:
            self._metrics.generation_tokens.inc(len(outputs))
        if batch:
            self._post(_deliver, batch)

    def _fail_all(self, error: Exception) -> None:
        sinks = {}
        for rid, (sink, _, _) in list(self._live.items()):
            sinks[id(sink)] = sink
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 (the request may already be gone with the failed step)
                pass
        self._live.clear()
        for sink in sinks.values():
            self._post(sink.fail, error)
        self._publish()

    def _post(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the event loop (dropped once it has closed: nobody waits any more)."""
        try:
            self._aloop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    def _publish(self) -> None:
        s, cfg = self.engine.scheduler, self.engine.runner.config
        total = cfg.num_blocks - 1
        self.snapshot = Snapshot(len(s.running), len(s.waiting), total - self.engine.runner.blocks.num_free, total)


def _settle(future: asyncio.Future, error: Exception | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _deliver(batch: list[tuple[Sink, int, RequestOutput]]) -> None:
    for sink, k, out in batch:
        sink.push(k, out)


def now() -> float:
    """The clock of arrival times (the engine's metrics use the same one)."""
    return time.perf_counter()
