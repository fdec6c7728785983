"""Text out: the bytes of every token id of a tokenizer, and per-request incremental detokenization
with stop strings matched on bytes (``fullgraph.vocab.StopMatcher``).

Working on bytes, not strings, keeps a token that is half a UTF-8 character exact (a string
decoder would turn it into U+FFFD) and finds a stop string that spans tokens or starts inside
one. A request's text is the UTF-8 decoding of its tokens' bytes, released to the stream as it
becomes final: bytes that could still begin a stop string are held back, and so is a trailing
partial character.
"""
from __future__ import annotations

import codecs
import json
from collections.abc import Sequence

from ..vocab import StopMatcher, token_bytes


def _byte_level_table() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2, Llama-3, SmolLM2, Qwen): each byte is drawn as one
    printable character; printable Latin-1 bytes as themselves, the others shifted past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _decoder_kinds(tokenizer) -> set[str]:
    """The types in a fast tokenizer's decoder chain (``ByteLevel``, ``ByteFallback``, ``Metaspace``, ...)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return {p.get("type") for p in parts if p}


def tokenizer_token_bytes(tokenizer, vocab_size: int) -> tuple[list[bytes], frozenset[int]]:
    """(the bytes of each id in ``[0, vocab_size)``, the ids of special tokens). Ids the tokenizer
    does not cover (an embedding padded past the vocabulary) are ``b""``."""
    vocab = tokenizer.get_vocab()                     # str token -> id
    kinds = _decoder_kinds(tokenizer)
    special = frozenset(i for i in getattr(tokenizer, "all_special_ids", []) if 0 <= i < vocab_size)
    added = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    if "ByteLevel" in kinds:
        table = _byte_level_table()

        def to_bytes(tok: str) -> bytes:
            if tok in added or any(c not in table for c in tok):
                return tok.encode()
            return bytes(table[c] for c in tok)
    elif kinds & {"ByteFallback", "Metaspace", "Replace"}:
        def to_bytes(tok: str) -> bytes:
            if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                return bytes([int(tok[3:5], 16)])
            return tok.replace("\u2581", " ").encode()
    else:
        def to_bytes(tok: str) -> bytes:
            return tokenizer.convert_tokens_to_string([tok]).encode()
    by_id: list[bytes | None] = [None] * vocab_size
    for tok, i in vocab.items():
        if 0 <= i < vocab_size:
            by_id[i] = to_bytes(tok)
    return token_bytes(by_id, vocab_size), special


class RequestText:
    """The text of one request's output, token by token (see the module docstring)."""

    def __init__(self, token_bytes: Sequence[bytes], special: frozenset[int], stop: Sequence[str],
                 skip_special_tokens: bool, include_stop: bool) -> None:
        self._bytes = token_bytes
        self._skip = special if skip_special_tokens else frozenset()
        self._matcher = StopMatcher(token_bytes, stop) if stop else None
        self._hold = max((len(s.encode()) for s in stop), default=1) - 1
        self._include = include_stop
        self._out = bytearray()
        self._released = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.stop: str | None = None

    def add(self, token_id: int) -> str:
        """Take one token; returns the text it makes final (may be ""). Sets ``stop`` when a stop
        string completes (the text then ends before it, or after it with ``include_stop``)."""
        if token_id in self._skip or self.stop is not None:
            return ""
        if self._matcher is not None:
            match = self._matcher.feed(token_id)
            self._out = self._matcher.output
            if match is not None:
                self.stop = match.stop.decode(errors="replace")
                end = match.keep + (len(match.stop) if self._include else 0)
                return self._release(end, final=True)
        else:
            self._out += self._bytes[token_id]
        return self._release(len(self._out) - self._hold)

    def finish(self) -> str:
        """The rest of the text (a trailing partial character becomes U+FFFD)."""
        return self._release(len(self._out), final=True) if self.stop is None else ""

    def _release(self, end: int, final: bool = False) -> str:
        end = max(end, self._released)
        delta = self._decoder.decode(bytes(self._out[self._released: end]), final=final)
        self._released = end
        self.text += delta
        return delta
