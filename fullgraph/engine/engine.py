"""Engine: requests in, tokens and text out, over one sampling runner.

``add_request`` validates a request (a ``ValueError`` naming it and the field, before anything
changes) and queues it; each ``step()`` schedules (``Scheduler``), runs one runner step (sampling
inside the graph) and returns a ``RequestOutput`` for every request that got a token, with the
text that token made final (``delta_text``) and, as its ``SamplingParams.output_kind`` asks, the
whole text and token ids so far (cumulative), only the new ones (delta), or nothing until the
request finishes (final_only).

The loop is overlapped by default: step N+1 is planned and launched before step N's tokens are
read, its decode tokens taking step N's samples on the device (``prev_token_row``), so the host's
work hides behind the device's. Finish decisions (eos, stop strings, ``max_tokens``) therefore lag
one step: a request that finished at step N still ran in step N+1, whose token for it is dropped.

With prefix caching (on by default; ``pages.py``) a request's first chunk starts after the longest
run of cached pages matching its prompt, and its own full prompt pages are cached once launched.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..fetch import HostFetch
from ..plan import SeqChunk
from ..runner import FullGraphRunner
from .pages import PrefixCache, kv_key
from .params import CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind, SamplingParams
from .scheduler import Request, Scheduler
from .text import RequestText, tokenizer_token_bytes


_ONE = (0,)  # the one token of a chunk whose id the graph reads from the previous step's sample
_DELTA, _FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


@dataclass
class _Launched:
    handle: int
    rows: list[Request | None]   # per chunk: the request whose next output this row samples


class Engine:
    """Continuous batching over ``runner`` (built with ``sampling=True``); see the module docstring.

    Args:
        runner: a ``FullGraphRunner(model, sampling=True, ...)``; the engine owns its pages.
        tokenizer: a transformers tokenizer for text prompts and text out, or None (token ids only).
        eos_token_ids: ids that end a request (unless ``ignore_eos``).
        seed: the generator of the seeds of requests that bring none.
        overlap: plan and launch each step before reading the previous one's tokens.
        token_bytes, special_token_ids: the bytes of every token id and which are special tokens,
            for structured output without a tokenizer object (e.g. ``vocab.token_bytes`` of a
            tiktoken vocabulary with its str special tokens).
        enable_prefix_caching: share the KV pages of prompt prefixes between requests by content
            (``engine.pages``): a request starts after its longest cached prefix. False: every
            prompt is computed from position 0.
    """

    def __init__(self, runner: FullGraphRunner, tokenizer=None, *, eos_token_ids: Iterable[int] = (), seed: int = 0,
                 overlap: bool = True, token_bytes: Sequence[bytes] | None = None,
                 special_token_ids: Iterable[int] = (), enable_prefix_caching: bool = True) -> None:
        if not runner.config.sampling:
            raise ValueError("Engine needs a runner that samples in its graph: FullGraphRunner(model, sampling=True)")
        cfg = runner.config
        self.runner, self.tokenizer, self.overlap = runner, tokenizer, overlap
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        key = kv_key(runner.model, runner.dtype, cfg.block_size)
        self.prefix_cache = PrefixCache(runner.blocks, cfg.block_size, key) if enable_prefix_caching else None
        self.scheduler = Scheduler(runner.blocks, cfg.block_size, cfg.max_num_seqs, cfg.max_num_tokens,
                                   self.prefix_cache)
        self._requests: dict[str, Request] = {}
        self._with_logprobs: set[str] = set()   # unfinished requests that asked for logprobs
        self._seeds = np.random.default_rng(seed)
        self._fetch = HostFetch({name: (tuple(t.shape), t.dtype) for name, t in runner.buffers.outputs.items()},
                                 runner.device)
        self._inflight: _Launched | None = None
        self._text_tables = None
        self._grammars = None
        self.token_bytes = None if token_bytes is None else list(token_bytes)
        if self.token_bytes is not None and len(self.token_bytes) != runner.vocab_size:
            raise ValueError(f"token_bytes: {len(self.token_bytes)} entries, expected one per token id of the "
                             f"model ({runner.vocab_size}; pad dummy ids with b'')")
        self.special_token_ids = frozenset(int(i) for i in special_token_ids)

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None) -> None:
        """Queue a request (see the class docstring); raises ``ValueError`` naming it and the field."""
        params = SamplingParams() if params is None else params
        who = f"request {request_id!r}"
        if request_id in self._requests:
            raise ValueError(f"{who}: request_id: already in use by an unfinished request")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"{who}: params: expected SamplingParams, got {type(params).__name__}")
        text_prompt, ids = self._prompt_ids(who, prompt)
        cfg = self.runner.config
        if len(ids) >= cfg.max_model_len:
            raise ValueError(f"{who}: prompt: {len(ids)} tokens leave no room to generate within max_model_len "
                             f"= {cfg.max_model_len}")
        max_len = min(len(ids) + (params.max_tokens or cfg.max_model_len), cfg.max_model_len)
        if -(-max_len // cfg.block_size) > cfg.num_blocks - 1:
            raise ValueError(f"{who}: max_tokens: up to {max_len} tokens need {-(-max_len // cfg.block_size)} KV "
                             f"pages; the cache has {cfg.num_blocks - 1}")
        if (params.stop or not params.skip_special_tokens) and self.tokenizer is None:
            raise ValueError(f"{who}: stop: stop strings need a tokenizer (this engine has none: token ids only)")
        matcher = self._matcher(who, params) if params.structured is not None else None
        if params.logprobs is not None and (not cfg.max_logprobs or params.logprobs > cfg.max_logprobs):
            # a runner built with max_logprobs=0 returns no logprobs at all, not even the sample's own
            returns = f"at most {cfg.max_logprobs}" if cfg.max_logprobs else "none (it was built with max_logprobs=0)"
            raise ValueError(f"{who}: logprobs: {params.logprobs} asked for, the runner returns {returns} "
                             "(LLM(max_logprobs=...) / RunnerConfig.max_logprobs)")
        seed = params.seed if params.seed is not None else int(self._seeds.integers(0, 2**62))
        text = self._request_text(params) if self.tokenizer is not None else None
        request = Request(str(request_id), text_prompt, ids, params, seed, text,
                          RequestMetrics(time.perf_counter(), num_prompt_tokens=len(ids)), max_len,
                          logprobs=[] if params.logprobs is not None else None, matcher=matcher)
        self._requests[request.request_id] = request
        if params.logprobs is not None:
            self._with_logprobs.add(request.request_id)
        self.scheduler.add(request)

    def _prompt_ids(self, who: str, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{who}: prompt: a text prompt needs a tokenizer (pass token ids, or a tokenizer)")
            ids = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
            text = prompt
        else:
            text, ids = None, list(prompt) if isinstance(prompt, Sequence) else None
            if ids is None:
                raise ValueError(f"{who}: prompt: expected a str or a sequence of token ids, got {type(prompt).__name__}")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))
               or not 0 <= t < self.runner.vocab_size]
        if bad:
            raise ValueError(f"{who}: prompt: token id {bad[0]!r} is not an int in [0, {self.runner.vocab_size})")
        if not ids:
            raise ValueError(f"{who}: prompt: empty (a request needs at least one token)")
        return text, [int(t) for t in ids]

    def _matcher(self, who: str, params: SamplingParams):
        if not self.runner.config.structured:
            raise ValueError(f"{who}: structured: this runner applies no token masks "
                             "(LLM(..., structured=True) / RunnerConfig(structured=True))")
        if self.tokenizer is None and self.token_bytes is None:
            raise ValueError(f"{who}: structured: constrained output needs the vocabulary's bytes (a tokenizer)")
        if self._grammars is None:
            from .structured import GrammarCompiler

            if self.token_bytes is not None:
                table, special, encode = self.token_bytes, self.special_token_ids, None
            else:
                (table, special), tok = self._tables(), self.tokenizer
                encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
            self._grammars = GrammarCompiler(table, special, sorted(self.eos_token_ids), encode)
        return self._grammars.matcher(params.structured, who)

    def _tables(self):
        if self._text_tables is None:
            self._text_tables = tokenizer_token_bytes(self.tokenizer, self.runner.vocab_size)
        return self._text_tables

    def _request_text(self, params: SamplingParams) -> RequestText:
        token_bytes, special = self._tables()
        return RequestText(token_bytes, special, params.stop, params.skip_special_tokens,
                           params.include_stop_str_in_output)

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its pages (a token of it still in flight is dropped)."""
        request = self._requests.pop(str(request_id), None)
        if request is None:
            raise ValueError(f"request {request_id!r}: request_id: no such unfinished request")
        request.finish_reason = "abort"
        self._with_logprobs.discard(request.request_id)
        self.scheduler.remove(request)

    def has_unfinished(self) -> bool:
        return bool(self._requests) or self._inflight is not None

    def stats(self) -> dict:
        """Requests, KV pages and the prefix cache: ``prefill_tokens`` (prompt tokens computed),
        ``prefix_cache_queries`` / ``_hits`` (tokens looked up / found cached, per admission),
        ``prefix_cache_hit_rate``, ``cached_pages`` (owned or evictable), ``evictable_pages``, ``evictions``."""
        blocks, sched, cache = self.runner.blocks, self.scheduler, self.prefix_cache
        return {"running": len(sched.running), "waiting": len(sched.waiting), "prefill_tokens": sched.prefill_tokens,
                "kv_pages_in_use": blocks.num_blocks - 1 - blocks.num_free, "prefix_caching": cache is not None,
                **(cache.stats() if cache is not None else PrefixCache.idle_stats())}

    # ---- steps -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs of the requests that got a token (see the module docstring)."""
        launched = self._launch()
        if self.overlap:
            done, self._inflight = self._inflight, launched
        else:
            done = launched
        if launched is None and done is None and self._requests:
            raise RuntimeError(f"the engine cannot schedule its {len(self._requests)} requests: the KV cache "
                               "cannot hold even one of them (raise num_blocks or lower max_tokens)")
        return self._collect(done) if done is not None else []

    def _launch(self) -> _Launched | None:
        slots = self.scheduler.schedule()
        if not slots:
            return None
        # one comprehension per list (a step of 64 decodes builds 64 chunks and 7 x 64 values);
        # a slot is (request, start, count, prev_row, samples)
        chunks = [SeqChunk(_ONE if prev >= 0 else r.tokens(start, start + count), start, r.blocks, r.request_id)
                  for r, start, count, prev, _ in slots]
        values = dict(zip(("temperature", "top_k", "top_p", "min_p", "seed"),
                          map(list, zip(*(s[0].sampling for s in slots)))))
        values["sample_offset"] = [len(s[0].outputs) + s[0].pending for s in slots]
        if all(s[2] == 1 for s in slots):
            values["prev_token_row"] = [s[3] for s in slots]
        else:
            values["prev_token_row"] = [row for _, _, count, prev, _ in slots for row in (*([-1] * (count - 1)), prev)]
        if self.runner.config.structured:
            self._masks(slots, values)
        out = self.runner.step(chunks, values=values)
        # the logprob outputs travel only while a request wants them (two copies fewer a step)
        fetch = {"token_ids": out.token_ids}
        if self._with_logprobs and out.logprobs is not None:
            fetch.update(logprobs=out.logprobs, top_ids=out.top_ids)
        handle = self._fetch.start(fetch)
        rows = []
        for i, (request, _, count, _, samples) in enumerate(slots):
            request.computed += count
            if samples:   # its next token is row i of this step's samples
                request.pending += 1
                request.row = i
            rows.append(request if samples else None)
            if request.num_registered < request.num_sealable:  # launched: later steps read its pages written
                self.prefix_cache.register(request)
        return _Launched(handle, rows)

    def _masks(self, slots, values: dict) -> None:
        """The constrained chunks' allowed-token masks (only when there is one: the field is big)."""
        flags = [int(samples and r.matcher is not None) for r, _, _, _, samples in slots]
        values["constrained"] = flags
        if any(flags):
            words = -(-self.runner.vocab_size // 32)
            masks = np.zeros((len(slots), words), dtype=np.int32)
            self._grammars.fill_masks([(s[0].matcher, i) for i, s in enumerate(slots) if flags[i]], masks)
            values["token_bitmask"] = masks

    def _collect(self, launched: _Launched) -> list[RequestOutput]:
        got = self._fetch.wait(launched.handle, len(launched.rows))
        tokens = got["token_ids"].tolist()
        now, outputs = time.perf_counter(), []
        for i, request in enumerate(launched.rows):
            if request is None:
                continue
            request.pending -= 1
            if request.finished:  # finished at the step before: this token is the surplus of the overlap
                continue
            out = self._take(request, tokens[i], got, i, now)
            if out is not None:
                outputs.append(out)
        return outputs

    def _take(self, request: Request, token: int, got: dict, row: int, now: float) -> RequestOutput | None:
        request.outputs.append(token)
        m = request.metrics
        m.first_token_time = m.first_token_time or now
        m.num_generated_tokens += 1
        if request.logprobs is not None:
            n = request.params.logprobs
            entry = {token: float(got["logprobs"][row, 0])}
            entry.update({int(t): float(lp) for t, lp in zip(got["top_ids"][row, :n], got["logprobs"][row, 1: n + 1])})
            request.logprobs.append(entry)
        delta = request.text.add(token) if request.text is not None else ""
        self._check_finish(request, token)
        if request.finished:
            if request.text is not None:
                delta += request.text.finish()
            m.finished_time = now
            self._requests.pop(request.request_id, None)
            self._with_logprobs.discard(request.request_id)
            self.scheduler.remove(request)
        elif request.params.output_kind is _FINAL_ONLY:
            return None
        return self._output(request, delta, token)

    def _check_finish(self, request: Request, token: int) -> None:
        p, grammar = request.params, request.matcher
        if grammar is not None and not (token in self.eos_token_ids and grammar.accepting):
            grammar.accept(token)
            if grammar.error is not None:
                request.finish_reason, request.stop_reason = "stop", "grammar_error"
                return
            if grammar.stopped:  # complete, and nothing may follow
                request.finish_reason, request.stop_reason = "stop", "grammar"
                return
        if not p.ignore_eos and token in self.eos_token_ids:
            request.finish_reason, request.stop_reason = "stop", token
        elif token in p.stop_token_ids:
            request.finish_reason, request.stop_reason = "stop", token
        elif request.text is not None and request.text.stop is not None:
            request.finish_reason, request.stop_reason = "stop", request.text.stop
        elif len(request.prompt_ids) + len(request.outputs) >= request.max_len:
            request.finish_reason = "length"
            if grammar is not None and not grammar.accepting:
                request.stop_reason = "grammar_incomplete"  # the constraint could not be met in max_tokens

    def _output(self, request: Request, delta: str, token: int) -> RequestOutput:
        if request.params.output_kind is _DELTA:
            completion = CompletionOutput(0, delta, [token], request.finish_reason, request.stop_reason,
                                          request.logprobs[-1:] if request.logprobs is not None else None, delta,
                                          [token])
        else:  # cumulative (and a final-only request's one output): copies, the caller's to keep
            completion = CompletionOutput(0, request.text.text if request.text is not None else "",
                                          list(request.outputs), request.finish_reason, request.stop_reason,
                                          list(request.logprobs) if request.logprobs is not None else None, delta,
                                          [token])
        return RequestOutput(request.request_id, request.prompt, request.prompt_out, [completion],
                             request.finished, request.metrics, request.metrics.num_cached_tokens)
