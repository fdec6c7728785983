"""Continuous batching: which tokens of which requests run in the next step, and their pages.

Every step runs the running requests' decode tokens first, then fills the token budget
(``max_num_tokens``) with prefill chunks: unfinished prefills of running requests, then waiting
requests admitted first come, first served, while fewer than ``max_num_seqs`` run. Pages are taken
from the runner's allocator as positions need them. When a decode needs a page and none is free,
the most recently admitted running request is preempted: its pages are released and it waits at
the head of the queue, to recompute its prompt and outputs later (same greedy tokens). The scheduler
owns every request's pages and positions; the caller never passes them.

With a ``PrefixCache`` (``pages.py``), an admitted request first takes the cached pages of its
longest cached prefix and starts its first chunk after them; pages are released, not freed, so a
cached page lives on, evictable, for the next request (or the preempted one, when it resumes).

With the engine's overlapped loop a request's newest token may still be on the device when the
next step is planned: ``pending`` counts such tokens, and the next step reads them where they lie
(a slot's ``prev_row``). A request's length known to the scheduler includes them. A constrained
request (structured output) waits a step instead: its next allowed-token mask needs that token.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from ..kv_cache import BlockAllocator
from .pages import PrefixCache
from .params import RequestMetrics, SamplingParams
from .text import RequestText


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    text: RequestText | None
    metrics: RequestMetrics
    max_len: int                      # prompt + outputs may not exceed this (max_tokens, max_model_len)
    outputs: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    blocks: list[int] = field(default_factory=list)
    computed: int = 0                 # tokens whose KV this request's launched steps write
    pending: int = 0                  # sampled tokens still on the device
    order: int = 0                    # admission order (preemption takes the latest)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    matcher: object = None            # structured output: the grammar state (engine.structured.Matcher)
    page_hashes: list[bytes] = field(default_factory=list)  # prefix cache: chained hashes of its full known pages
    num_registered: int = 0           # leading pages the prefix cache has dealt with (taken from it, or sealed)
    num_sealable: int = 0             # full pages of the tokens known at admission: those it may seal
    sampling: tuple = ()              # (temperature, top_k, top_p, min_p, seed): its rows of every step's fields
    row: int = -1                     # its row in the last launched step that samples for it (read while pending)
    prompt_out: list[int] = field(default_factory=list)   # the prompt ids its outputs show (a copy made once)

    def __post_init__(self) -> None:
        p = self.params
        self.sampling = (p.temperature, p.top_k, p.top_p, p.min_p, self.seed)
        self.prompt_out = list(self.prompt_ids)

    @property
    def length(self) -> int:
        """Prompt + outputs, the in-flight ones included."""
        return len(self.prompt_ids) + len(self.outputs) + self.pending

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def tokens(self, start: int, end: int) -> list[int]:
        """Host-known token ids of positions ``start .. end - 1`` (prompt, then outputs)."""
        seq = self.prompt_ids
        if end > len(seq):
            seq = seq + self.outputs
        return seq[start:end]


Slot = tuple[Request, int, int, int, bool]  # (request, start, count, prev_row, samples): see ``Scheduler.schedule``


class Scheduler:
    def __init__(self, blocks: BlockAllocator, block_size: int, max_num_seqs: int, max_num_tokens: int,
                 cache: PrefixCache | None = None) -> None:
        self.blocks, self.block_size, self.cache = blocks, block_size, cache
        self.max_num_seqs, self.max_num_tokens = max_num_seqs, max_num_tokens
        self.prefill_tokens = 0           # prompt tokens computed (a cache hit skips them; a recompute counts again)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._order = itertools.count()

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Drop a finished or aborted request and release its pages (safe while a launched step still
        uses them: every later step runs after it on the device)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free(request)

    def _free(self, request: Request) -> None:
        if request.blocks:
            self.blocks.release(request.blocks[::-1])  # its tail is evicted before the prefix others share
        request.blocks = []
        request.computed = request.num_registered = 0

    def _ensure_pages(self, request: Request, end: int) -> bool:
        """Pages covering positions ``< end`` (False, taking none, if too few are free)."""
        need = -(-end // self.block_size) - len(request.blocks)
        if need <= 0:
            return True
        if need > self.blocks.num_free:
            return False
        request.blocks.extend(self.blocks.allocate(need))  # in place: the runner's block-id cache sees the change
        return True

    def _preempt_latest(self) -> Request:
        """Preempt the latest-admitted running request (never one already in this step's chunks:
        those were admitted earlier); returns it."""
        victim = max(self.running, key=lambda r: r.order)
        self.running.remove(victim)
        self._free(victim)
        victim.metrics.num_preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def schedule(self) -> list[Slot]:
        """The next step's chunks, each a ``(request, start, count, prev_row, samples)`` tuple: the
        request's tokens at positions ``start .. start + count - 1``; ``prev_row``: the last of them
        is the step in flight's sample of that row (else -1); ``samples``: the step's sample of this
        chunk is the request's next output. (Plain tuples: a step makes one per running request,
        and a named tuple costs three times as much to build.) A request whose newest token is
        still on the device (``pending``) is the sample of row ``request.row`` of the step in
        flight (the engine sets it at launch)."""
        slots, bs, preempted, prefilling = [], self.block_size, set(), []
        add = slots.append
        # decodes first, oldest first: ``running`` is in admission order (admitted requests are
        # appended, with a growing ``order``), so no sort is needed. (The loop body is the
        # scheduler's cost at a large batch: ~1 us a request, so each test is as cheap as it gets.)
        for request in list(self.running):
            if preempted and id(request) in preempted:  # a later request preempted for an earlier one's page
                continue
            computed, pending = request.computed, request.pending
            length = len(request.prompt_ids) + len(request.outputs) + pending
            if computed < length - 1:
                prefilling.append(request)   # (a preemption below takes only later requests)
                continue
            if length >= request.max_len or (pending and request.matcher is not None):
                continue  # done; or constrained: its next mask needs the token still on the device
            if length > len(request.blocks) * bs:  # a page to take (rarely: once every block_size steps)
                while not self._ensure_pages(request, length):
                    victim = self._preempt_latest()
                    preempted.add(id(victim))
                    if victim is request:
                        break
                if id(request) in preempted:
                    continue
            add((request, computed, 1, request.row if pending else -1, True))
        budget = self.max_num_tokens - len(slots)
        for request in prefilling:  # unfinished prefills, in admission order
            budget = self._prefill(request, budget, slots)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.pending or not self._admit(request, budget):
                break
            self.waiting.popleft()
            request.order = next(self._order)
            self.running.append(request)
            budget = self._prefill(request, budget, slots)
        return slots

    def _admit(self, request: Request, budget: int) -> bool:
        """Give a waiting request its cached prefix (shared pages) and the pages of its first chunk
        (False, taking nothing, if too few are free)."""
        if self.cache is None:
            return self._ensure_pages(request, min(request.length, request.computed + budget))
        hits = self.cache.match(request)
        start = min(len(hits) * self.block_size, request.length - 1)
        need = -(-min(request.length, start + budget) // self.block_size) - len(hits)
        revived = int((self.blocks.owners(hits) == 0).sum())  # evictable pages: counted in num_free
        if need + revived > self.blocks.num_free:
            return False
        self.blocks.share(hits)
        request.blocks.extend(hits)
        request.blocks.extend(self.blocks.allocate(need))
        request.computed = start
        self.cache.admitted(request, len(hits))
        if not request.metrics.num_preemptions:  # the prompt tokens served from the cache, as first admitted
            request.metrics.num_cached_tokens = start
        return True

    def _prefill(self, request: Request, budget: int, slots: list[Slot]) -> int:
        """A chunk of ``request``'s remaining prompt (and, after preemption, its outputs)."""
        todo = request.length - request.computed
        count = min(todo, budget)
        if count <= 0 or not self._ensure_pages(request, request.computed + count):
            return budget
        slots.append((request, request.computed, count, -1, count == todo))
        # its prompt tokens; one left for the decode loop (a chunk ending just short of it) counts now
        self.prefill_tokens += max(0, min(count + (count == todo - 1), len(request.prompt_ids) - request.computed))
        return budget - count
