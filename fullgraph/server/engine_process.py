"""The engine in a process of its own: the server's default (``ServerConfig.engine_process``).

In one process the engine thread and the event loop's per-token streaming take turns on one
interpreter lock; on an H200 the engine's own host work is most of each step, and the HTTP
server delivered 51% of the in-process engine's tokens per second (BENCHMARKS.md). So, as vLLM's
V1 engine core does, the engine runs in a child process (started with ``spawn``: CUDA is never
forked) that loads the model, owns the device and steps ``fg.Engine``; the server process keeps
HTTP, tokenization, the response shaping and the metrics.

They talk over one ``multiprocessing`` pipe of pickled tuples, in order:

    server -> engine   ("add", group, [(request id, prompt ids, SamplingParams), ...])
                       ("abort", [request id, ...])     ("stop",)
    engine -> server   ("ready", EngineInfo) | ("load_failed", message)
                       ("accepted", group, None | (is_value_error, message))
                       ("step", [Delta, ...], aborted ids, Snapshot)
                       ("failed", message)              (a step raised: its requests are gone)

A step's outputs go out as one message of deltas (the new token ids, text and logprobs, the
finish fields and metrics: never a request's prompt or whole history, which would make each
step's message grow with the context); the server side keeps each request's prompt and
cumulative output and rebuilds a whole ``RequestOutput`` from each delta, so the response code
sees what the engine returned. Between two steps the child applies every command that arrived.
The child ignores SIGINT (Ctrl-C in the terminal reaches the whole process group): the server
drains its requests and then stops it. :class:`ProcessEngineLoop` is the server side, with :class:`~.loop.EngineLoop`'s
interface (``submit``, ``abort``, ``snapshot``, ``stop``): a reader thread receives (blocking
in ``recv``, which releases the lock) and hands each step to the event loop in one call.

Tensor parallel (``tensor_parallel_size`` N > 1 under ``torchrun``): rank 0 is this server and
its engine process; ranks 1 .. N-1 run ``followers.follow``, which makes the calls and steps
rank 0's engine sends before each step (``followers.Followers``).
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..engine import CompletionOutput, RequestOutput, RequestOutputKind, SamplingParams
from .followers import HEARTBEAT_S, Followers
from .loop import EngineFailed, Sink, Snapshot, _deliver, _settle
from .metrics import ServerMetrics

logger = logging.getLogger("fullgraph.server")


@dataclass(frozen=True)
class EngineInfo:
    """What the server process needs to know of the runner the engine process built."""

    max_num_seqs: int
    max_model_len: int
    num_blocks: int
    cudagraph: str
    vocab_size: int
    max_logprobs: int
    structured: bool
    has_tokenizer: bool


def info_of(llm) -> EngineInfo:
    cfg = llm.runner.config
    return EngineInfo(cfg.max_num_seqs, cfg.max_model_len, cfg.num_blocks, cfg.cudagraph, llm.runner.vocab_size,
                      cfg.max_logprobs, bool(cfg.structured), llm.tokenizer is not None)


# one request's step in the step message: (request id, new token ids, new text, new logprob
# entries or None, finish reason, stop reason, finished, metrics, cached prompt tokens)
Delta = tuple


def _delta(out: RequestOutput) -> Delta:
    c = out.outputs[0]
    n = len(c.delta_token_ids)
    logprobs = None if c.logprobs is None else c.logprobs[max(0, len(c.logprobs) - n):]
    return (out.request_id, list(c.delta_token_ids), c.delta_text, logprobs, c.finish_reason, c.stop_reason,
            out.finished, out.metrics, out.num_cached_tokens)


@dataclass
class _Mirror:
    """The server side's copy of one request: its prompt and cumulative output."""

    sink: Sink
    choice: int
    arrival: float
    prompt: list[int]
    token_ids: list[int]
    text: str = ""
    logprobs: list | None = None

    def apply(self, delta: Delta) -> RequestOutput:
        rid, new_ids, new_text, new_logprobs, reason, stop_reason, finished, metrics, cached = delta
        self.token_ids.extend(new_ids)
        self.text += new_text
        if new_logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(new_logprobs)
        completion = CompletionOutput(0, self.text, self.token_ids, reason, stop_reason, self.logprobs, new_text,
                                      new_ids)
        return RequestOutput(rid, None, self.prompt, [completion], finished, metrics, cached)


def _snapshot(engine) -> Snapshot:
    s, total = engine.scheduler, engine.runner.config.num_blocks - 1
    return Snapshot(len(s.running), len(s.waiting), total - engine.runner.blocks.num_free, total)


def _main(config, conn) -> None:
    """The engine process: load, say ready, then step while there is work and apply commands."""
    import signal

    from .config import load_llm

    signal.signal(signal.SIGINT, signal.SIG_IGN)    # the server drains on Ctrl-C, then stops us
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        llm = load_llm(config)
    except Exception as err:  # noqa: BLE001 (reported to the server, which stops with it)
        conn.send(("load_failed", str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"))
        return
    engine, live = llm.engine, set()
    followers = Followers(engine) if getattr(llm.runner.model, "tensor_parallel", None) is not None else None
    if followers is not None:
        engine = followers          # its add_request / abort calls are logged for the other ranks
    conn.send(("ready", info_of(llm)))
    while True:
        if not engine.has_unfinished():
            # nothing to step: sleep until a command comes (leading ranks: at most a heartbeat)
            conn.poll(None if followers is None else HEARTBEAT_S)
        aborted = []
        while conn.poll():
            command = conn.recv()
            if command[0] == "stop":
                if followers is not None:   # a spawned process skips atexit: leave the group now
                    followers.send(None)
                    from ..parallel import close_tensor_parallel

                    close_tensor_parallel()
                return
            if command[0] == "abort":
                for rid in command[1]:
                    if rid in live:
                        live.discard(rid)
                        engine.abort(rid)
                        aborted.append(rid)
                continue
            _, group, items = command
            added = []
            try:
                for rid, prompt, params in items:
                    # only each step's new tokens cross to the server (it keeps the whole output)
                    engine.add_request(rid, prompt, replace(params, output_kind=RequestOutputKind.DELTA))
                    added.append(rid)
            except Exception as err:  # noqa: BLE001 (a ValueError is the client's; anything else is ours)
                for rid in added:
                    engine.abort(rid)
                if not isinstance(err, ValueError):
                    logger.exception("fullgraph: add_request failed")
                conn.send(("accepted", group, (isinstance(err, ValueError),
                                               str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}")))
                continue
            live.update(added)
            conn.send(("accepted", group, None))
        outputs: list[Delta] = []
        if followers is not None:   # the other ranks make the same calls, then step with us
            followers.send(engine.has_unfinished())
        if engine.has_unfinished():
            try:
                results = engine.step()
            except Exception as err:  # noqa: BLE001 (fail these requests, keep serving)
                logger.exception("fullgraph: an engine step failed")
                for rid in live:
                    try:
                        engine.abort(rid)
                    except Exception:  # noqa: BLE001 (the request may already be gone with the failed step)
                        pass
                live.clear()
                conn.send(("failed", f"the engine step failed: {type(err).__name__}: {err}"))
                conn.send(("step", [], aborted, _snapshot(engine)))
                continue
            outputs = [_delta(out) for out in results if out.request_id in live]
            live.difference_update(out.request_id for out in results if out.finished)
        conn.send(("step", outputs, aborted, _snapshot(engine)))


class ProcessEngineLoop:
    """The server side of the engine process (see the module docstring): ``launch``, then
    ``wait_ready`` (the model is loaded), then ``start``."""

    def __init__(self, config, aloop: asyncio.AbstractEventLoop, metrics: ServerMetrics | None = None) -> None:
        self._config, self._aloop, self._metrics = config, aloop, metrics
        self._live: dict[str, _Mirror] = {}                        # reader thread only
        self._groups: dict[int, tuple[asyncio.Future, Sink, list, float]] = {}
        self._next_group = 0
        self._send_lock = threading.Lock()
        self._stopped = False
        self._gone: str | None = None                             # why the engine process is gone
        self.snapshot = Snapshot()
        self.info: EngineInfo | None = None
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._process = ctx.Process(target=_main, args=(config, child), name="fullgraph-engine", daemon=True)
        self._child_conn = child
        self._reader = threading.Thread(target=self._read, name="fullgraph-engine-reader", daemon=True)

    @property
    def gone(self) -> str | None:
        """Why the engine process is gone (None while it serves)."""
        return None if self._stopped else self._gone

    def launch(self) -> None:
        """Spawn the engine process (it starts loading the model)."""
        self._process.start()
        self._child_conn.close()

    def wait_ready(self) -> EngineInfo:
        """Block until the engine process has loaded the model; ``ValueError`` saying why it could not."""
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self._process.join(10)
            raise ValueError(f"the engine process exited while loading (exit code {self._process.exitcode})") from None
        if kind == "load_failed":
            self._process.join(10)
            raise ValueError(payload)
        self.info = payload
        self.snapshot = Snapshot(pages_total=payload.num_blocks - 1)
        return payload

    def start(self) -> None:
        """Start relaying the engine's steps to the event loop (after :meth:`wait_ready`)."""
        self._reader.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Fail what still runs (503) and end the engine process (also while it still loads)."""
        self._stopped = True
        if self._process.is_alive() and self._gone is None:
            self._send(("stop",))
            self._process.join(timeout)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout)
        if self._reader.is_alive():
            self._reader.join(timeout)

    # ---- the event loop's side ---------------------------------------------------------------
    async def submit(self, items: Sequence[tuple[str, list[int], SamplingParams]], arrival: float) -> Sink:
        """Queue ``(request id, prompt ids, params)`` as one group: all accepted, or a ``ValueError``."""
        if self._gone is not None:
            raise EngineFailed(self._gone)
        sink = Sink([rid for rid, _, _ in items])
        accepted = self._aloop.create_future()
        group, self._next_group = self._next_group, self._next_group + 1
        items = list(items)
        self._groups[group] = (accepted, sink, items, arrival)
        if not self._send(("add", group, items)) or self._gone is not None:  # (gone meanwhile: nobody answers)
            self._groups.pop(group, None)
            raise EngineFailed(self._gone or "the engine process is not running")
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(sink)
            raise
        return sink

    def abort(self, sink: Sink) -> None:
        """Stop ``sink``'s unfinished requests and free their pages (idempotent)."""
        if sink.unfinished and self._gone is None:
            self._send(("abort", list(sink.ids)))

    def _send(self, message: tuple) -> bool:
        with self._send_lock:
            try:
                self._conn.send(message)
                return True
            except (BrokenPipeError, OSError):
                return False

    # ---- the reader thread -------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "step":
                    self._step(*message[1:])
                elif kind == "accepted":
                    self._accepted(*message[1:])
                elif kind == "failed":
                    self._fail_running(EngineFailed(message[1]))
        except (EOFError, OSError):
            pass
        except BaseException:  # noqa: BLE001 (the thread must not die silently)
            logger.exception("fullgraph: the engine reader stopped")
        self._process.join(1)
        self._gone = "the server is shutting down" if self._stopped else \
            f"the engine process stopped (exit code {self._process.exitcode})"
        if not self._stopped:
            logger.error("fullgraph: %s", self._gone)
        self._fail_all(EngineFailed(self._gone))

    def _accepted(self, group: int, error) -> None:
        pending = self._groups.pop(group, None)
        if pending is None:  # failed meanwhile (the engine went away): nobody waits for it
            return
        future, sink, items, arrival = pending
        if error is not None:
            is_value_error, text = error
            self._post(_settle, future, ValueError(text) if is_value_error else EngineFailed(f"could not queue the "
                                                                                             f"request: {text}"))
            return
        for k, (rid, prompt, _) in enumerate(items):
            self._live[rid] = _Mirror(sink, k, arrival, prompt, [])
        if self._metrics is not None:
            self._metrics.prompt_tokens.inc(sum(len(p) for _, p, _ in items))
        self._post(_settle, future, None)

    def _step(self, deltas: list[Delta], aborted: list[str], snapshot: Snapshot) -> None:
        batch = []
        for delta in deltas:
            mirror = self._live.get(delta[0])
            if mirror is None:
                continue
            out = mirror.apply(delta)
            batch.append((mirror.sink, mirror.choice, out))
            if out.finished:
                del self._live[out.request_id]
                if self._metrics is not None:
                    self._metrics.request_finished(out, mirror.arrival)
        for rid in aborted:
            if self._live.pop(rid, None) is not None and self._metrics is not None:
                self._metrics.finished.labels("abort").inc()
        if self._metrics is not None and deltas:
            self._metrics.generation_tokens.inc(len(deltas))
        self.snapshot = snapshot
        if batch:
            self._post(_deliver, batch)

    def _fail_running(self, error: Exception) -> None:
        """Fail the requests the engine ran (a step failed); queued groups stay queued."""
        sinks = {id(m.sink): m.sink for m in self._live.values()}
        self._live.clear()
        for sink in sinks.values():
            self._post(sink.fail, error)

    def _fail_all(self, error: Exception) -> None:
        """The engine is gone: fail what runs and every group still waiting for its answer."""
        self._fail_running(error)
        while self._groups:
            try:
                _, (future, _, _, _) = self._groups.popitem()
            except KeyError:
                break
            self._post(_settle, future, error)

    def _post(self, fn, *args) -> None:
        try:
            self._aloop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass
