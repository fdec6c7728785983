"""Structured output: a request's tokens constrained to a JSON schema, a regex, a Lark grammar or
a list of choices, through an allowed-token bitmask the graph applies before sampling.

The automaton work is llguidance's (an optional extra, ``pip install 'fullgraph[structured]'``):
a Rust engine maintained with the guidance project and used by vLLM, SGLang and llama.cpp, which
computes a mask over a 128K vocabulary in tens of microseconds (its slicer skips most of the
vocabulary per state), and which takes a vocabulary as plain per-token bytes. We feed it ours
(``engine.text.tokenizer_token_bytes`` / ``vocab.token_bytes``), so BPE pieces, byte-fallback
tokens, special tokens and dummy ids past the tokenizer (Phi-3-Small's mixed bytes/str
vocabulary) are exactly what the model emits. Special tokens get llguidance's 0xFF marker, so a
grammar never matches them as text.
"""
from __future__ import annotations

import functools
import importlib.metadata
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@functools.cache
def _llguidance():
    """The llguidance module, checked once (a version lookup reads the installed metadata: ~0.2 ms)."""
    try:
        import llguidance
    except ImportError:
        raise ValueError("structured output needs llguidance (pip install 'fullgraph[structured]')") from None
    version = importlib.metadata.version("llguidance")
    if tuple(int(p) for p in re.findall(r"\d+", version)[:2]) < (1, 7):  # older ones take a single end token
        raise ValueError(f"structured output needs llguidance >= 1.7 (several end-of-sequence tokens); "
                         f"{version} is installed")
    return llguidance


@dataclass(frozen=True)
class Structured:
    """Exactly one of: ``json_schema`` (a dict or its JSON text), ``regex``, ``grammar`` (Lark
    syntax, llguidance's dialect), ``choice`` (the output is one of these strings)."""

    json_schema: dict | str | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: Sequence[str] | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("json_schema", "regex", "grammar", "choice") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"Structured: give exactly one of json_schema, regex, grammar, choice (got {given or 'none'})")
        if self.choice is not None:
            choices = [self.choice] if isinstance(self.choice, str) else list(self.choice)
            if not choices or any(not isinstance(c, str) or not c for c in choices):
                raise ValueError(f"Structured.choice: expected non-empty strings, got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(choices))
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"Structured.{name}: expected a str, got {type(getattr(self, name)).__name__}")

    def grammar_text(self) -> str:
        """The llguidance grammar of this constraint (a bad schema raises ``ValueError``)."""
        m = _llguidance().LLMatcher
        if self.json_schema is not None:
            try:
                return m.grammar_from_json_schema(self.json_schema)
            except (ValueError, TypeError) as err:
                raise ValueError(f"json_schema: {err}") from None
        if self.regex is not None:
            return m.grammar_from_regex(self.regex)
        if self.grammar is not None:
            return m.grammar_from_lark(self.grammar)
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))


class _Vocab:
    """The tokenizer llguidance sees: our token bytes (TokenizerWrapper's protocol)."""

    def __init__(self, token_bytes: Sequence[bytes], special: frozenset[int], eos: int | None,
                 encode: Callable[[str], list[int]] | None) -> None:
        self.tokens = [b"\xff" + b if i in special else b for i, b in enumerate(token_bytes)]
        self.special_token_ids = sorted(special)
        self.eos_token_id = eos if eos is not None else -1
        self.bos_token_id = None
        self.is_tokenizer_wrapper = True
        self._encode = encode

    def __call__(self, text) -> list[int]:
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        if self._encode is not None:
            return self._encode(text)
        return _greedy_encode(self.tokens, text.encode())

    _encode_string = __call__


def _greedy_encode(tokens: Sequence[bytes], data: bytes) -> list[int]:
    """Longest-match encoding over a raw vocabulary (for vocabularies with no tokenizer object)."""
    by_bytes = {b: i for i, b in enumerate(tokens) if b and not b.startswith(b"\xff")}
    longest = max(map(len, by_bytes), default=1)
    out, i = [], 0
    while i < len(data):
        for n in range(min(longest, len(data) - i), 0, -1):
            if data[i: i + n] in by_bytes:
                out.append(by_bytes[data[i: i + n]])
                i += n
                break
        else:
            raise ValueError(f"the vocabulary cannot encode byte {data[i]:#x}")
    return out


class GrammarCompiler:
    """One vocabulary's grammar engine: ``matcher(structured, who)`` compiles a request's
    constraint (a bad one is a ``ValueError`` naming ``who``)."""

    def __init__(self, token_bytes: Sequence[bytes], special: frozenset[int], eos_token_ids: Sequence[int],
                 encode: Callable[[str], list[int]] | None = None) -> None:
        llg = _llguidance()
        eos = sorted(eos_token_ids)
        vocab = _Vocab(token_bytes, special, eos[0] if eos else None, encode)
        self.vocab_size = len(token_bytes)
        self._tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(vocab), n_vocab=self.vocab_size,
                                          eos_token=eos or None)
        self._executor = None

    def matcher(self, structured: Structured, who: str) -> Matcher:
        try:
            text = structured.grammar_text()
        except ValueError as err:
            raise ValueError(f"{who}: structured: {err}") from None
        m = _llguidance().LLMatcher(self._tokenizer, text, log_level=0)
        if m.is_error():
            raise ValueError(f"{who}: structured: {m.get_error().splitlines()[0]}")
        return Matcher(m, self.vocab_size)

    def fill_masks(self, matchers: Sequence[tuple[Matcher, int]], out: np.ndarray) -> None:
        """Each ``(matcher, row)``'s allowed next tokens into ``out[row]`` ((R, ceil(V / 32))
        int32), computed in parallel on llguidance's threads (they release the GIL)."""
        if self._executor is None:
            self._executor = _llguidance().LLExecutor()
        from llguidance.numpy import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(self._executor, [(m._m, row) for m, row in matchers], out)


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._m, self.vocab_size = matcher, vocab_size

    def mask(self) -> np.ndarray:
        """The allowed next tokens, packed: (ceil(V / 32),) int32, bit v % 32 of word v // 32."""
        words = np.frombuffer(self._m.compute_bitmask(), dtype=np.int32)
        return words[: -(-self.vocab_size // 32)]

    def accept(self, token: int) -> bool:
        return bool(self._m.consume_token(token))

    @property
    def accepting(self) -> bool:
        return bool(self._m.is_accepting())

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows no further token (but eos)."""
        return bool(self._m.is_stopped()) and not self._m.is_error()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None
