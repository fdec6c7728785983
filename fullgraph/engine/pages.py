"""The prefix cache (automatic prefix caching): KV pages shared by requests whose prompts begin alike.

A **full** page of a request is named by a hash chained over its parent page's hash and its own
token ids, the chain seeded with a key of what else decides the KV (the model's class and config,
the dtype, the page size), so equal token blocks under different prefixes are different pages. A
stable digest (blake2b, 16 bytes; about 1.5 us a page on a slow CPU core), not Python's ``hash``,
so a page's name means the same in every process.

A new request takes the longest run of cached pages matching its known tokens, but only pages
covering positions ``< length - 1`` (rounded down to a page): its last known token is always
computed, since the step needs its logits, and a page it writes is never one it shares. So a
shared page is never written: the partial last page of a prompt is private, and so is every page
the request grows into. The allocator's ledger holds the ownership (``BlockAllocator.share`` /
``release`` / ``seal``) and refuses a step that writes a cached page.

A page is registered (sealed) once the step writing its last position has been *launched*: with
the overlapped loop the page's KV may still be in flight on the device, but every later step runs
after it on the same stream, so any later step that reads the page reads it written. Only pages
covered by tokens known when the request was admitted are registered (its prompt, and after a
preemption its earlier outputs): the ids of tokens sampled since may still be on the device.
"""
from __future__ import annotations

from hashlib import blake2b

import numpy as np

from ..kv_cache import BlockAllocator

_DIGEST = 16


class PrefixCache:
    """Content hash -> cached page, over a ``BlockAllocator`` (which keeps reference counts and the
    evictable pages, least recently released first, and tells ``_forget`` when it evicts one)."""

    def __init__(self, blocks: BlockAllocator, block_size: int, kv_key: str) -> None:
        self.blocks, self.block_size = blocks, block_size
        self._root = blake2b(kv_key.encode(), digest_size=_DIGEST).digest()
        self._page: dict[bytes, int] = {}      # hash -> cached page (owned or evictable)
        self._hash: dict[int, bytes] = {}      # cached page -> hash
        self.lookups = self.query_tokens = self.hit_tokens = 0
        blocks.on_evict = self._forget

    def full_pages(self, num_tokens: int) -> int:
        """Pages fully covered by ``num_tokens`` tokens (only those are ever shared)."""
        return num_tokens // self.block_size

    def hashes(self, request) -> list[bytes]:
        """The chained hashes of ``request``'s full pages of known tokens (extending the ones it has)."""
        have, want = len(request.page_hashes), self.full_pages(request.length)
        if want > have:
            width = self.block_size * 8
            data = np.asarray(request.tokens(have * self.block_size, want * self.block_size), np.int64).tobytes()
            parent = request.page_hashes[-1] if have else self._root
            for i in range(0, len(data), width):
                parent = blake2b(parent + data[i: i + width], digest_size=_DIGEST).digest()
                request.page_hashes.append(parent)
        return request.page_hashes

    def match(self, request) -> list[int]:
        """The cached pages of ``request``'s longest cached prefix that leaves its last known token to
        compute (nothing is taken: ``BlockAllocator.share`` does that)."""
        pages = []
        for h in self.hashes(request)[: self.full_pages(request.length - 1)]:
            page = self._page.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def admitted(self, request, num_hits: int) -> None:
        """``request`` was admitted with its first ``num_hits`` pages from the cache."""
        self.lookups += 1
        self.query_tokens += request.length
        self.hit_tokens += num_hits * self.block_size
        request.num_registered = num_hits
        request.num_sealable = self.full_pages(request.length)

    def register(self, request) -> None:
        """Seal and name ``request``'s full pages whose last position a launched step writes (see
        the module docstring). A page whose content is cached already under another page (a request
        that computed the same prefix while its first owner was still prefilling it) stays private."""
        upto = min(self.full_pages(request.computed), request.num_sealable)
        new = []
        for i in range(request.num_registered, upto):
            h = request.page_hashes[i]
            if h not in self._page:
                page = request.blocks[i]
                self._page[h], self._hash[page] = page, h
                new.append(page)
        self.blocks.seal(new, self.block_size)
        request.num_registered = max(upto, request.num_registered)

    def _forget(self, page: int) -> None:
        h = self._hash.pop(page, None)
        if h is not None:
            del self._page[h]

    def stats(self) -> dict:
        return {"prefix_cache_queries": self.query_tokens, "prefix_cache_hits": self.hit_tokens,
                "prefix_cache_hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
                "prefix_cache_lookups": self.lookups, "cached_pages": self.blocks.num_cached,
                "evictable_pages": self.blocks.num_evictable, "evictions": self.blocks.evictions}

    @staticmethod
    def idle_stats() -> dict:
        """``stats()`` of an engine without a prefix cache (every counter 0)."""
        return {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "prefix_cache_hit_rate": 0.0,
                "prefix_cache_lookups": 0, "cached_pages": 0, "evictable_pages": 0, "evictions": 0}


def kv_key(model, dtype, block_size: int) -> str:
    """What decides the KV of a page besides its tokens: the model's class and config, the dtype
    and the page size (the engine's cache lives with one runner, so its weights are fixed)."""
    cls = type(model)
    return f"{cls.__module__}.{cls.__qualname__}|{getattr(model, 'config', None)!r}|{dtype}|{block_size}"
