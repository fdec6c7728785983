"""Engine outputs in the shapes of OpenAI's API: completion and chat bodies, their streamed chunks,
``usage``, and logprobs (completions: ``{tokens, token_logprobs, top_logprobs, text_offset}``;
chat: ``{content: [{token, logprob, bytes, top_logprobs}]}``).

A choice ``k`` is fed ``RequestOutput``s of its engine request; ``Choice`` keeps what has been
sent. Streamed chunks carry every choice that got tokens since the last chunk (several steps'
tokens coalesce into one chunk when the client reads slower than the engine steps).
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..engine import RequestOutput
from .protocol import Job

_FLOOR = -9999.0  # a masked token's -inf logprob, as vLLM writes it (JSON has no infinity)
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode  # built once: per chunk


class Vocab:
    """Each token id's bytes (None without a tokenizer: tokens are written ``token_id:N``)."""

    def __init__(self, token_bytes: Sequence[bytes] | None) -> None:
        self.bytes = token_bytes

    def text(self, token: int) -> str:
        if self.bytes is None:
            return f"token_id:{token}"
        return self.bytes[token].decode("utf-8", errors="replace")

    def raw(self, token: int) -> list[int]:
        return list(self.bytes[token]) if self.bytes is not None else []


def _lp(value: float) -> float:
    return value if math.isfinite(value) else _FLOOR


def _top(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:n]


def completion_logprobs(tokens: Sequence[int], entries: Sequence[dict[int, float]], n: int, vocab: Vocab,
                        offset: int = 0) -> dict:
    texts = [vocab.text(t) for t in tokens]
    offsets, at = [], offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {"tokens": texts, "token_logprobs": [_lp(e[t]) for t, e in zip(tokens, entries)],
            "top_logprobs": [{vocab.text(i): _lp(lp) for i, lp in _top(e, n)} for e in entries],
            "text_offset": offsets}


def chat_logprobs(tokens: Sequence[int], entries: Sequence[dict[int, float]], n: int, vocab: Vocab) -> dict:
    def one(token: int, lp: float) -> dict:
        return {"token": vocab.text(token), "logprob": _lp(lp), "bytes": vocab.raw(token)}

    return {"content": [{**one(t, e[t]), "top_logprobs": [one(i, lp) for i, lp in _top(e, n)]}
                        for t, e in zip(tokens, entries)]}


@dataclass
class Choice:
    """What one choice has produced and what of it has been sent."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cached_tokens: int | None = None
    sent_text: int = 0
    sent_tokens: int = 0
    prompt_tokens: int = 0

    def feed(self, out: RequestOutput) -> None:
        c = out.outputs[0]
        self.text += c.delta_text
        self.token_ids.extend(c.delta_token_ids)
        if c.logprobs is not None:
            self.logprobs = c.logprobs
        self.prompt_tokens = len(out.prompt_token_ids)
        if out.finished:
            self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason
            self.cached_tokens = getattr(out.metrics, "num_cached_tokens", None)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Shaper:
    """One job's bodies and chunks (see the module docstring)."""

    def __init__(self, job: Job, vocab: Vocab) -> None:
        self.job, self.vocab = job, vocab
        self.created = int(time.time())
        self.choices = [Choice(k) for k in range(job.num_choices)]
        self._chunk_head = self._chunk_tail = None

    # ---- shared pieces -----------------------------------------------------------------------
    def usage(self) -> dict:
        prompt = sum(c.prompt_tokens for c in self.choices[:: self.job.n])  # once per prompt, not per choice
        completion = sum(len(c.token_ids) for c in self.choices)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        cached = [c.cached_tokens for c in self.choices[:: self.job.n] if c.cached_tokens is not None]
        if cached:
            usage["prompt_tokens_details"] = {"cached_tokens": sum(cached)}
        return usage

    def _logprobs(self, c: Choice, start: int, end: int, offset: int = 0) -> dict | None:
        if self.job.logprobs is None:
            return None
        tokens, entries = c.token_ids[start:end], c.logprobs[start:end]
        if self.job.kind == "chat":
            return chat_logprobs(tokens, entries, self.job.logprobs, self.vocab)
        return completion_logprobs(tokens, entries, self.job.logprobs, self.vocab, offset)

    def _extras(self, c: Choice, start: int, end: int, final: bool) -> dict:
        extra = {"stop_reason": c.stop_reason} if final and c.stop_reason is not None else {}
        if self.job.return_token_ids:
            extra["token_ids"] = c.token_ids[start:end]
        return extra

    def _head(self, obj: str) -> dict:
        return {"id": self.job.id, "object": obj, "created": self.created, "model": self.job.model}

    # ---- whole responses ---------------------------------------------------------------------
    def body(self) -> dict:
        choices = []
        for c in self.choices:
            logprobs = self._logprobs(c, 0, len(c.token_ids))
            if self.job.kind == "chat":
                choice = {"index": c.index, "message": {"role": "assistant", "content": c.text}}
            else:
                choice = {"index": c.index, "text": c.text}
            choices.append({**choice, "logprobs": logprobs, "finish_reason": c.finish_reason,
                            **self._extras(c, 0, len(c.token_ids), True)})
        obj = "chat.completion" if self.job.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": choices, "usage": self.usage()}

    # ---- streams -------------------------------------------------------------------------------
    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.job.kind == "chat" else "text_completion"

    def _event(self, payload: dict) -> bytes:
        return b"data: " + _encode(payload).encode() + b"\n\n"

    def opening(self) -> bytes | None:
        """Chat streams open with each choice's role (OpenAI's first chunk)."""
        if self.job.kind != "chat":
            return None
        choices = [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for c in self.choices]
        return self._chunk(choices)

    def _chunk(self, choices: list[dict]) -> bytes:
        if self._chunk_head is None:  # the same id, object, created, model in every chunk: encoded once
            self._chunk_head = b"data: " + _encode(self._head(self._chunk_object)).encode()[:-1] + b',"choices":'
            self._chunk_tail = b',"usage":null}\n\n' if self.job.include_usage else b"}\n\n"
        return self._chunk_head + _encode(choices).encode() + self._chunk_tail

    def chunk(self, touched: Sequence[int]) -> bytes:
        """The unsent part of choices ``touched``, as one chunk."""
        choices = []
        for k in touched:
            c = self.choices[k]
            text, start, end = c.text[c.sent_text:], c.sent_tokens, len(c.token_ids)
            logprobs = self._logprobs(c, start, end, c.sent_text)
            if self.job.kind == "chat":
                choice = {"index": k, "delta": {"content": text} if text or not c.finished else {}}
            else:
                choice = {"index": k, "text": text}
            choices.append({**choice, "logprobs": logprobs, "finish_reason": c.finish_reason,
                            **self._extras(c, start, end, c.finished)})
            c.sent_text, c.sent_tokens = len(c.text), end
        return self._chunk(choices)

    def closing(self) -> bytes:
        """The usage chunk (when asked for) and ``[DONE]``."""
        tail = b""
        if self.job.include_usage:
            tail = self._event({**self._head(self._chunk_object), "choices": [], "usage": self.usage()})
        return tail + b"data: [DONE]\n\n"


def error_event(body: dict) -> bytes:
    """An error in the middle of a stream (the openai client raises it), then the end."""
    return b"data: " + _encode(body).encode() + b"\n\ndata: [DONE]\n\n"
