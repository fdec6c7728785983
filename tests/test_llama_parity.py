"""Our Llama against transformers' LlamaForCausalLM with the same random weights (float32, CPU)."""
from __future__ import annotations

import pytest
import torch

import fullgraph as fg

transformers = pytest.importorskip("transformers")

ROPE = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
}


def hf_model(rope: str, tied: bool, seed: int = 0):
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, rope_parameters=ROPE[rope],
        tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger-than-default weights so logits are far from uniform
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.2)
    return model


@pytest.mark.parametrize("rope,tied", [("default", True), ("llama3", False)])
@pytest.mark.parametrize("cudagraph", ["none", "padded"])
def test_logits_match_transformers(tmp_path, rope, tied, cudagraph):
    ref = hf_model(rope, tied)
    ref.save_pretrained(tmp_path)
    model = fg.models.Llama.from_pretrained(tmp_path)
    assert model.config.tie_word_embeddings == tied and (model.config.rope_scaling is not None) == (rope == "llama3")
    tokens = torch.randint(0, 300, (1, 90)).tolist()[0]
    with torch.no_grad():
        expected = ref(torch.tensor([tokens])).logits[0].double()          # (90, vocab)

    runner = fg.FullGraphRunner(model, max_num_seqs=4, max_num_tokens=64, max_model_len=128,
                                cudagraph=cudagraph, attention="sdpa")
    blocks = runner.blocks.allocate(6)
    got = []
    # Chunked prefill (40 + 33 tokens, the second chunk crossing pages) then 17 decode steps.
    for start, end in [(0, 40), (40, 73)] + [(p, p + 1) for p in range(73, 90)]:
        out = runner.step([fg.SeqChunk(tokens[start:end], start, blocks)])
        got.append((end - 1, out.logits[0].double()))
    for pos, logits in got:
        err = (logits - expected[pos]).abs().max() / expected[pos].abs().max()
        assert err < 1e-4, f"position {pos}: relative error {err:.2e}"


def test_from_hf_reads_both_rope_spellings():
    old = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
           "num_attention_heads": 2, "rope_theta": 123.0,
           "rope_scaling": {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 16}}
    c = fg.models.LlamaConfig.from_hf(old)
    assert c.rope_theta == 123.0 and c.rope_scaling["factor"] == 2.0 and c.num_kv_heads == 2
    new = {**old, "rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 77.0}}
    new.pop("rope_theta")
    c = fg.models.LlamaConfig.from_hf(new)
    assert c.rope_theta == 77.0 and c.rope_scaling is None


def test_strict_loading_names_the_tensor(tmp_path):
    model = fg.models.Llama(fg.models.LlamaConfig.toy())
    sd = {"model." + k: v for k, v in model.state_dict().items()}
    model.load_hf_state_dict(dict(sd))                               # fused names (Phi-3's layout) load as they are
    split = {k: v for k, v in sd.items() if "qkv_proj" not in k}
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.weight"):
        model.load_hf_state_dict(split)
    missing = {k: v for k, v in sd.items() if k != "model.layers.1.mlp.down_proj.weight"}
    with pytest.raises(ValueError, match="missing tensors \\['model.layers.1.mlp.down_proj.weight'\\]"):
        model.load_hf_state_dict(missing)
    wrong = {**sd, "model.norm.weight": torch.ones(65)}
    with pytest.raises(ValueError, match="model.norm.weight: checkpoint \\(65,\\) vs model \\(64,\\)"):
        model.load_hf_state_dict(wrong)
