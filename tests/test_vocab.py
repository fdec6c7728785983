"""fullgraph.vocab on a small vocabulary shaped like Phi-3-Small's: BPE tokens as bytes (some of
them halves of a UTF-8 character), special tokens as str at their real ids, dummy ids absent."""
from __future__ import annotations

import pytest

from fullgraph.vocab import StopMatch, StopMatcher, token_bytes

VOCAB_SIZE = 100352
ENDOFTEXT, END, ENDOFPROMPT = 100257, 100266, 100276


def phi3_like_vocab() -> dict[bytes | str, int]:
    bpe = [b"Hello", b" world", b"\xe2\x82", b"\xac", b"\n", b"<|", b"end", b"|>", b" 5", b"\xff"]
    vocab: dict[bytes | str, int] = {tok: i for i, tok in enumerate(bpe)}
    vocab.update({"<|endoftext|>": ENDOFTEXT, "<|end|>": END, "<|endofprompt|>": ENDOFPROMPT,
                  "<|user|>": 100262})
    return vocab


def test_mixed_bytes_and_str_become_bytes():
    tb = token_bytes(phi3_like_vocab(), VOCAB_SIZE)
    assert len(tb) == VOCAB_SIZE and all(type(b) is bytes for b in tb)
    assert tb[0] == b"Hello" and tb[2] == b"\xe2\x82" and tb[9] == b"\xff"   # invalid UTF-8 kept exact
    assert tb[ENDOFTEXT] == b"<|endoftext|>" and tb[END] == b"<|end|>" and tb[100262] == b"<|user|>"
    assert tb[100256] == b"" and tb[100300] == b"" and tb[VOCAB_SIZE - 1] == b""   # dummy / padding ids
    assert tb[2] + tb[3] == "€".encode()


def test_sequence_vocabulary_with_holes():
    tb = token_bytes([b"a", None, "<|end|>", bytearray(b"\x80")], 6)
    assert tb == [b"a", b"", b"<|end|>", b"\x80", b"", b""]


@pytest.mark.parametrize("vocab, match", [
    ({b"a": 0, 7: 1}, "expected bytes or str, got int"),
    ([b"a", 3.5], "expected bytes or str, got float"),
    ({b"a": 0, "a": 0}, "used twice"),
    ({b"a": 0, "<|endoftext|>": 6}, r"outside \[0, 6\)"),
    ({b"a": -1}, "outside"),
    ({b"a": "0"}, "id must be an int"),
    ({b"a": True}, "id must be an int"),
    ("abc", "mapping token -> id or a sequence"),
])
def test_bad_vocabularies_raise(vocab, match):
    with pytest.raises(ValueError, match=match):
        token_bytes(vocab, 6)


def test_bad_vocab_size_raises():
    with pytest.raises(ValueError, match="vocab_size"):
        token_bytes({b"a": 0}, 0)


def feed_all(matcher: StopMatcher, ids: list[int]) -> StopMatch | None:
    for i in ids:
        match = matcher.feed(i)
        if match is not None:
            return match
    return None


def test_stop_string_across_tokens_and_inside_a_character():
    tb = token_bytes(phi3_like_vocab(), VOCAB_SIZE)
    ids = phi3_like_vocab()
    m = StopMatcher(tb, stop=["<|end|>"])
    # The stop string spelled by three BPE tokens (not the special token) is found.
    match = feed_all(m, [ids[b"Hello"], ids[b"<|"], ids[b"end"], ids[b"|>"], ids[b" world"]])
    assert match == StopMatch(b"<|end|>", len(b"Hello"))
    assert bytes(m.output[: match.keep]) == b"Hello"
    with pytest.raises(ValueError, match="already stopped"):
        m.feed(ids[b" world"])
    euro = StopMatcher(tb, stop=["€"])
    assert euro.feed(ids[b"Hello"]) is None and euro.feed(ids[b"\xe2\x82"]) is None
    assert euro.feed(ids[b"\xac"]) == StopMatch("€".encode(), len(b"Hello"))


def test_stop_token_ids_and_earliest_stop_string():
    tb = token_bytes(phi3_like_vocab(), VOCAB_SIZE)
    m = StopMatcher(tb, stop=[b"world", "o w"], stop_token_ids=[ENDOFTEXT, END])
    assert m.feed(0) is None
    assert m.feed(1) == StopMatch(b"o w", 4)               # "Hello world": "o w" starts first
    m = StopMatcher(tb, stop=["never"], stop_token_ids=[END])
    assert feed_all(m, [0, 1, END]) == StopMatch(END, len(b"Hello world"))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        StopMatcher(tb).feed(VOCAB_SIZE)
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(tb, stop=[""])
