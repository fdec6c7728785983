"""Token vocabularies as bytes, and a stop-string matcher over token ids.

Tokenizers such as Phi-3-Small's (tiktoken cl100k) hold BPE tokens as ``bytes`` and special tokens
(``<|endoftext|>``, ``<|end|>``) as ``str``. Code that walks a vocabulary (grammar masks, stop
strings) must see one type: :func:`token_bytes` turns every entry into ``bytes`` (str as UTF-8), so a
BPE token that is half a UTF-8 character stays exact instead of crashing a ``str`` assumption.
"""
from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

Token = bytes | str


def _as_bytes(token: object, what: str) -> bytes:
    if isinstance(token, (bytes, bytearray)):
        return bytes(token)
    if isinstance(token, str):
        return token.encode("utf-8")
    raise ValueError(f"{what}: expected bytes or str, got {type(token).__name__} {token!r:.40}")


def _as_id(value: object, token: object) -> int:
    if isinstance(value, bool):
        raise ValueError(f"token {token!r:.40}: id must be an int, got bool {value}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"token {token!r:.40}: id must be an int, got {type(value).__name__} {value!r:.40}") from None


def token_bytes(vocab: Mapping[Token, int] | Sequence[Token | None], vocab_size: int) -> list[bytes]:
    """The bytes of every token id in ``[0, vocab_size)``.

    ``vocab`` is either a mapping token -> id (bytes BPE tokens and str special tokens mixed, as
    tokenizers' ``get_vocab()`` / tiktoken's ranks plus specials) or a sequence indexed by id
    (``None`` for a hole). Ids the vocabulary does not cover (e.g. padding up to the embedding
    size, dummy ids) map to ``b""``. Raises ``ValueError`` for an entry that is neither bytes nor
    str, an id outside ``[0, vocab_size)``, or two tokens with the same id.
    """
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if isinstance(vocab, Mapping):
        items = [(_as_id(i, tok), tok) for tok, i in vocab.items()]
    elif isinstance(vocab, Sequence) and not isinstance(vocab, (str, bytes, bytearray)):
        items = [(i, tok) for i, tok in enumerate(vocab) if tok is not None]
    else:
        raise ValueError(f"vocab must be a mapping token -> id or a sequence of tokens, got {type(vocab).__name__}")
    out: list[bytes | None] = [None] * vocab_size
    for i, tok in items:
        if not 0 <= i < vocab_size:
            raise ValueError(f"token {tok!r:.40}: id {i} outside [0, {vocab_size})")
        if out[i] is not None:
            raise ValueError(f"token id {i} is used twice: {out[i]!r:.40} and {tok!r:.40}")
        out[i] = _as_bytes(tok, f"token id {i}")
    return [b"" if b is None else b for b in out]


@dataclass(frozen=True)
class StopMatch:
    """Why generation stopped: ``stop`` is the stop string (bytes) or the stop token id; ``keep``
    is how many bytes of the output to return (everything before the stop string or token)."""

    stop: bytes | int
    keep: int


class StopMatcher:
    """Finds stop strings in generated text, one token id at a time.

    Matching is on bytes, so a stop string that spans several tokens, or starts in the middle of
    a token (even in the middle of a UTF-8 character), is found. Stop token ids stop at once and
    add no bytes. ``feed`` returns a :class:`StopMatch` at the first stop (the earliest-starting
    stop string wins), ``None`` otherwise; after a stop, feeding more raises ``ValueError``.
    """

    def __init__(self, token_bytes: Sequence[bytes], stop: Iterable[Token] = (),
                 stop_token_ids: Iterable[int] = ()) -> None:
        self.token_bytes = token_bytes
        self.stops = tuple(_as_bytes(s, "stop string") for s in stop)
        if any(not s for s in self.stops):
            raise ValueError("stop strings must be non-empty")
        self.stop_token_ids = frozenset(_as_id(i, "stop_token_ids") for i in stop_token_ids)
        self._overlap = max((len(s) for s in self.stops), default=1) - 1
        self.output = bytearray()
        self.match: StopMatch | None = None

    def feed(self, token_id: int) -> StopMatch | None:
        if self.match is not None:
            raise ValueError(f"already stopped ({self.match}); create a new StopMatcher per request")
        if token_id in self.stop_token_ids:
            self.match = StopMatch(token_id, len(self.output))
            return self.match
        if not 0 <= token_id < len(self.token_bytes):
            raise ValueError(f"token id {token_id} outside the vocabulary [0, {len(self.token_bytes)})")
        start = max(0, len(self.output) - self._overlap)   # a match may begin in earlier tokens
        self.output += self.token_bytes[token_id]
        found = [(pos, s) for s in self.stops if (pos := self.output.find(s, start)) >= 0]
        if found:
            pos, s = min(found)
            self.match = StopMatch(s, pos)
        return self.match
