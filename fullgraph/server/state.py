"""A server's state: the model loading in the background, then the engine loop, the tokenizer
(used off the event loop) and running one parsed ``Job``: queue its choices, then gather or stream."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from .config import ServerConfig, load_llm, load_server_tokenizer
from .engine_process import EngineInfo, ProcessEngineLoop, info_of
from .loop import ClientGone, EngineFailed, EngineLoop, Sink
from .metrics import ServerMetrics
from .protocol import ApiError, Job, Served, bad, from_value_error
from .responses import Shaper, Vocab, error_event

logger = logging.getLogger("fullgraph.server")


class ServerState:
    def __init__(self, config: ServerConfig, loader: Callable[[], object] | None = None) -> None:
        self.config, self.created = config, int(time.time())
        self.metrics = ServerMetrics()
        # the engine in a process of its own (engine_process.py), unless a loader hands us an
        # fg.LLM of this process (tests) or the config says so
        self._in_process = loader is not None or not config.engine_process
        self._loader = loader or (lambda: load_llm(config))
        self.tokenizer = self.info = self.loop = self.served = self.vocab = None
        self._loading: ProcessEngineLoop | None = None   # the engine process until it is ready
        self._closed = False
        self.load_error: str | None = None
        self.on_load_error: Callable[[str], None] | None = None
        # one tokenizer thread: the tokenizer is not used from two threads at once, and a long
        # prompt never blocks the event loop or the engine thread
        self._tokenize = ThreadPoolExecutor(1, thread_name_prefix="fullgraph-tokenize")

    # ---- life ------------------------------------------------------------------------------
    def start(self, aloop: asyncio.AbstractEventLoop) -> None:
        """Load in a background thread (the server answers 503 meanwhile)."""
        threading.Thread(target=self._load, args=(aloop,), name="fullgraph-load", daemon=True).start()

    def _load(self, aloop: asyncio.AbstractEventLoop) -> None:
        try:
            if self._in_process:
                llm = self._loader()
                loop = EngineLoop(llm.engine, aloop, self.metrics)
                self._ready(info_of(llm), llm.tokenizer, loop)
            else:
                self._loading = loop = ProcessEngineLoop(self.config, aloop, self.metrics)
                loop.launch()                                 # the engine process loads the model ...
                tokenizer = load_server_tokenizer(self.config)  # ... while this one loads the tokenizer
                info = loop.wait_ready()
                if self._closed:
                    loop.stop()
                    return
                self._ready(info, tokenizer, loop)
        except Exception as err:  # noqa: BLE001 (reported; the command exits with it)
            if self._loading is not None:  # an engine process that loads, or loaded, for nothing
                self._loading.stop()
            self.load_error = f"{type(err).__name__}: {err}" if not isinstance(err, ValueError) else str(err)
            logger.error("fullgraph: loading the model failed: %s", self.load_error)
            if self.on_load_error is not None:
                self.on_load_error(self.load_error)

    def _ready(self, info: EngineInfo, tokenizer, loop) -> None:
        tokens = None
        if tokenizer is not None:
            from ..engine.text import tokenizer_token_bytes

            tokens = tokenizer_token_bytes(tokenizer, info.vocab_size)[0]
        self.vocab = Vocab(tokens)
        self.served = Served(self.config.served_model_names, info.max_logprobs, tokenizer is not None, info.structured)
        self.metrics.watch(lambda: loop.snapshot)
        loop.start()
        self.tokenizer, self.info, self.loop = tokenizer, info, loop  # last: requests see a ready server only now
        logger.info("fullgraph: serving %s (max_num_seqs %d, max_model_len %d, %d KV pages, %s%s, the engine %s)",
                    ", ".join(self.served.names), info.max_num_seqs, info.max_model_len, info.num_blocks - 1,
                    info.cudagraph, "" if tokenizer is not None else ", token ids only",
                    "in this process" if self._in_process else "in its own process")

    def close(self) -> None:
        self._closed = True
        if self.loop is not None:
            self.loop.stop()
        elif self._loading is not None:  # stopping while the engine process still loads
            self._loading.stop()
        self._tokenize.shutdown(wait=False, cancel_futures=True)

    def require_ready(self) -> None:
        gone = getattr(self.loop, "gone", None)
        if gone is not None:  # the engine process died: nothing here can serve again
            raise ApiError(503, gone, None, "engine_gone")
        if self.loop is None:
            why = f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            raise ApiError(503, f"{why}; try again shortly" if not self.load_error else why, None,
                           "model_not_ready")

    # ---- prompts -----------------------------------------------------------------------------
    async def prompt_ids(self, job: Job) -> list[list[int]]:
        """Each prompt of ``job`` as token ids (text tokenized, chat templated, off the event loop)."""
        tok = self.tokenizer
        if job.kind == "chat":
            if tok is None:
                raise bad("this server has no tokenizer, so no chat template: use /v1/completions with token ids",
                          "messages")
            return [await self._run_tokenizer(self._chat_ids, job.prompts[0])]
        out = []
        for prompt in job.prompts:
            if isinstance(prompt, str):
                if tok is None:
                    raise bad("prompt: this server has no tokenizer: send token ids (a list of ints)", "prompt")
                prompt = await self._run_tokenizer(lambda p: list(tok(p, add_special_tokens=True)["input_ids"]),
                                                   prompt)
            out.append(list(prompt))
        return out

    def _chat_ids(self, messages: list[dict]) -> list[int]:
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                         return_dict=False)
        except Exception as err:  # noqa: BLE001 (a template's refusal is the client's: jinja raises its own types)
            raise bad(f"messages: the chat template refused them: {type(err).__name__}: {err}", "messages") from None
        return list(ids)

    async def _run_tokenizer(self, fn, arg):
        return await asyncio.get_running_loop().run_in_executor(self._tokenize, fn, arg)

    # ---- running a job -----------------------------------------------------------------------
    async def submit(self, job: Job, prompts: list[list[int]], arrival: float) -> Sink:
        """Queue ``job``'s choices (a 400 if the engine refuses one: then none is queued)."""
        items = [(f"{job.id}-{k}", prompts[k // job.n], job.params[k]) for k in range(job.num_choices)]
        try:
            return await self.loop.submit(items, arrival)
        except ValueError as err:
            raise from_value_error(err) from None
        except EngineFailed as err:
            raise ApiError(500, str(err)) from None

    async def gather(self, job: Job, sink: Sink) -> dict:
        """The whole response body (``ClientGone`` if the client leaves first; its requests are aborted)."""
        shaper = Shaper(job, self.vocab)
        try:
            while sink.unfinished:
                for k, out in await sink.next():
                    shaper.choices[k].feed(out)
        except EngineFailed as err:
            raise ApiError(500, str(err)) from None
        finally:
            self.loop.abort(sink)
        return shaper.body()

    async def events(self, job: Job, sink: Sink) -> AsyncIterator[bytes]:
        """The server-sent events of a stream; the requests are aborted if it stops early."""
        shaper = Shaper(job, self.vocab)
        try:
            opening = shaper.opening()
            if opening is not None:
                yield opening
            while sink.unfinished:
                touched = set()
                for k, out in await sink.next():
                    shaper.choices[k].feed(out)
                    touched.add(k)
                yield shaper.chunk(sorted(touched))
            yield shaper.closing()
        except EngineFailed as err:
            yield error_event(ApiError(500, str(err)).body())
        finally:
            self.loop.abort(sink)


class Disconnect:
    """Watches one HTTP request's ``receive`` for the client leaving; then fails its sink with
    ``ClientGone`` (which wakes the handler: no polling)."""

    def __init__(self, receive) -> None:
        self.gone, self._sink = False, None
        self._task = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        if self._sink is not None:
            self._sink.fail(ClientGone())

    def attach(self, sink: Sink) -> None:
        self._sink = sink
        if self.gone:
            sink.fail(ClientGone())

    def close(self) -> None:
        self._task.cancel()
