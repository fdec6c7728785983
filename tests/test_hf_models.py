"""Every supported Hugging Face architecture against transformers itself (float32, CPU).

Tiny random checkpoints of each architecture and config variant are saved with
``save_pretrained`` and loaded with ``fg.models.from_pretrained``; our runner (chunked prefill,
then decode) must give transformers' eager logits at every position and ``generate``'s greedy
tokens. Then ``from_hf`` (storage shared with the transformers model) and the strict config and
checkpoint refusals.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import fullgraph as fg
from fullgraph.generate import greedy
from fullgraph.models.hf import llama_config

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB, HIDDEN, HEADS, KV_HEADS, FFN = 300, 64, 4, 2, 96
BASE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
            num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
            attn_implementation="eager")
WINDOW = 16
PARITY_LEN = 90                  # tokens of the logits parity sequence
SCHEDULE = [(0, 40), (40, 73)] + [(p, p + 1) for p in range(73, PARITY_LEN)]  # chunked prefill, then decode
NEW_TOKENS = 32


def _longrope(original: int) -> dict:
    half = (HIDDEN // HEADS) // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": original,
            "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [1.5 + 0.5 * i for i in range(half)]}


@dataclass(frozen=True)
class Case:
    arch: str                            # transformers' class prefix: Llama, Mistral, Qwen2, Qwen3, Phi3
    config: dict = field(default_factory=dict)
    max_model_len: int = 256             # ours and the runner's
    prompt_lens: tuple[int, ...] = (61, 77)
    sharded: bool = False
    windows: tuple[int | None, ...] = (None, None)   # each layer's sliding window
    drop: tuple[str, ...] = ()           # keys removed from the saved config.json (older transformers wrote none)
    rope_factors: str | None = None      # LongRoPE: the factor list our model must have chosen


PHI3_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
CASES = {
    "llama": Case("Llama"),
    "llama-tied": Case("Llama", dict(tie_word_embeddings=True)),
    "llama-llama3": Case("Llama", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "llama-linear": Case("Llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "llama-yarn": Case("Llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                      "original_max_position_embeddings": 64})),
    "llama-bias": Case("Llama", dict(attention_bias=True, mlp_bias=True), sharded=True),
    "llama-head-dim": Case("Llama", dict(head_dim=32, tie_word_embeddings=True)),
    "mistral-window": Case("Mistral", dict(sliding_window=WINDOW), windows=(WINDOW, WINDOW)),
    # no layer_types in config.json: the sliding layers come from max_window_layers (layer 1 slides)
    "qwen2-window": Case("Qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
                         windows=(None, WINDOW), drop=("layer_types",)),
    "qwen3": Case("Qwen3", dict(head_dim=16)),
    "qwen3-window": Case("Qwen3", dict(head_dim=32, attention_bias=True, use_sliding_window=True,
                                       sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
                         windows=(WINDOW, None)),
    "phi3": Case("Phi3", PHI3_IDS),
    "phi3-window": Case("Phi3", dict(PHI3_IDS, sliding_window=WINDOW), windows=(WINDOW, WINDOW)),
    # every position <= original (128), and our model built for at most 128 tokens: short factors
    "phi3-longrope-short": Case("Phi3", dict(PHI3_IDS, rope_parameters=_longrope(128),
                                             original_max_position_embeddings=128),
                                max_model_len=128, rope_factors="short"),
    # prompts longer than original (64), our model built for 256: long factors everywhere
    "phi3-longrope-long": Case("Phi3", dict(PHI3_IDS, rope_parameters=_longrope(64),
                                            original_max_position_embeddings=64),
                               prompt_lens=(70, 85), rope_factors="long"),
}
WINDOWED = ["mistral-window", "qwen2-window", "qwen3-window", "phi3-window"]


def hf_model(case: Case, seed: int = 0):
    """A transformers model of ``case`` with random weights, norms and biases (never 1 and 0, so a
    miswired norm or bias shows), scaled so logits are far from uniform."""
    config = getattr(transformers, f"{case.arch}Config")(**{**BASE, **case.config})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{case.arch}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.2)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """case name -> (transformers model, its saved directory, our model loaded from it); built once."""
    cache = {}

    def get(name: str):
        if name not in cache:
            case = CASES[name]
            ref = hf_model(case)
            path = tmp_path_factory.mktemp(name)
            ref.save_pretrained(path, **({"max_shard_size": "40KB"} if case.sharded else {}))
            if case.drop:
                config = json.loads((path / "config.json").read_text())
                (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in case.drop}))
            ours = fg.models.from_pretrained(path, max_model_len=case.max_model_len)
            cache[name] = ref, path, ours
        return cache[name]
    return get


def _runner(model, case: Case, attention: str = "sdpa") -> fg.FullGraphRunner:
    return fg.FullGraphRunner(model, max_num_seqs=4, max_num_tokens=128, max_model_len=case.max_model_len,
                              cudagraph="padded", attention=attention)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected.double()).abs().max() / expected.double().abs().max())


def _check_positions(runner: fg.FullGraphRunner, ref, seed: int, num_steps: int = PARITY_LEN) -> None:
    """Two sequences in the same steps: ``a`` in SCHEDULE's chunks (chunked prefill, then decode),
    ``b`` one token a step from position 0 (every position's logits); each returned row against
    transformers' full forward."""
    a, b = _tokens(PARITY_LEN, seed), _tokens(PARITY_LEN, seed + 1)
    with torch.no_grad():
        expected = ref(torch.tensor([a, b])).logits                               # (2, T, vocab)
    blocks = [runner.blocks.allocate(-(-PARITY_LEN // runner.config.block_size)) for _ in range(2)]
    for step in range(num_steps):
        chunks, rows = [fg.SeqChunk(b[step:step + 1], step, blocks[1])], [(1, step)]
        if step < len(SCHEDULE):
            start, end = SCHEDULE[step]
            chunks.insert(0, fg.SeqChunk(a[start:end], start, blocks[0]))
            rows.insert(0, (0, end - 1))
        for logits, (seq, pos) in zip(runner.step(chunks).logits, rows):
            err = _relative_error(logits, expected[seq, pos])
            assert err < 1e-4, f"sequence {'ab'[seq]}, position {pos}: relative error {err:.2e}"
    for ids in blocks:
        runner.blocks.free(ids)


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(checkpoint, name):
    ref, _, ours = checkpoint(name)
    case = CASES[name]
    assert isinstance(ours, fg.models.Llama) and ours.rope_factors == case.rope_factors
    assert tuple(layer.sliding_window for layer in ours.attention_layers()) == case.windows
    _check_positions(_runner(ours, case), ref, seed=1)


@pytest.mark.parametrize("name", WINDOWED)
def test_logits_match_transformers_triton(checkpoint, name):
    ref, _, ours = checkpoint(name)
    # the interpreter is slow: sequence b only up to position len(SCHEDULE) - 1 (past the window)
    _check_positions(_runner(ours, CASES[name], attention="triton"), ref, seed=2, num_steps=len(SCHEDULE))


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_matches_generate(checkpoint, name):
    ref, _, ours = checkpoint(name)
    case = CASES[name]
    prompts = [_tokens(n, seed=10 + i) for i, n in enumerate(case.prompt_lens)]
    got = greedy(_runner(ours, case), prompts, NEW_TOKENS).tokens     # the prompts batched in one runner
    for prompt, tokens in zip(prompts, got):
        ids = torch.tensor([prompt])
        with torch.no_grad():  # eos outside the vocabulary: every call runs all NEW_TOKENS steps
            out = ref.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                               eos_token_id=VOCAB, pad_token_id=0)
        expected = out[0, len(prompt):].tolist()
        assert len(expected) == NEW_TOKENS and tokens == expected


def test_sharded_checkpoint_loads_every_shard(checkpoint):
    ref, path, ours = checkpoint("llama-bias")
    shards = set(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) > 1 and len(list(path.glob("*.safetensors"))) == len(shards)
    hf = ref.state_dict()
    q, k, v = (hf[f"model.layers.1.self_attn.{n}_proj.bias"] for n in "qkv")
    assert torch.equal(ours.layers[1].self_attn.qkv_proj.bias, torch.cat([q, k, v]))
    assert torch.equal(ours.layers[1].mlp.down_proj.bias, hf["model.layers.1.mlp.down_proj.bias"])
    assert torch.equal(ours.lm_head.weight, hf["lm_head.weight"])


# ---- from_hf: a transformers model object, its storage shared ------------------------------------
def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


@pytest.mark.parametrize("name", ["llama-tied", "qwen2-window"])
def test_from_hf_shares_storage(name):
    case = CASES[name]
    ref = hf_model(case, seed=3)
    tokens = _tokens(PARITY_LEN, seed=4)
    with torch.no_grad():
        before = ref(torch.tensor([tokens])).logits[0]
    ours = fg.models.from_hf(ref, max_model_len=case.max_model_len)
    c, m = ours.config, ref.model
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    for i, (layer, theirs) in enumerate(zip(ours.layers, m.layers)):
        attn, mlp = theirs.self_attn, theirs.mlp
        kinds = ("weight", "bias") if c.qkv_bias else ("weight",)
        for kind in kinds:
            fused = getattr(layer.self_attn.qkv_proj, kind)
            row = fused[0].numel() * fused.element_size() if fused.dim() == 2 else fused.element_size()
            assert _ptr(fused) == _ptr(getattr(attn.q_proj, kind)), (i, kind)
            assert _ptr(getattr(attn.k_proj, kind)) == _ptr(fused) + q_size * row, (i, kind)
            assert _ptr(getattr(attn.v_proj, kind)) == _ptr(fused) + (q_size + kv_size) * row, (i, kind)
        gate_up = layer.mlp.gate_up_proj.weight
        assert _ptr(gate_up) == _ptr(mlp.gate_proj.weight)
        assert _ptr(mlp.up_proj.weight) == _ptr(gate_up) + c.intermediate_size * HIDDEN * gate_up.element_size()
        for ours_p, theirs_p in [(layer.self_attn.o_proj.weight, attn.o_proj.weight),
                                 (layer.mlp.down_proj.weight, mlp.down_proj.weight),
                                 (layer.input_layernorm.weight, theirs.input_layernorm.weight),
                                 (layer.post_attention_layernorm.weight, theirs.post_attention_layernorm.weight)]:
            assert _ptr(ours_p) == _ptr(theirs_p), i
    assert _ptr(ours.embed_tokens.weight) == _ptr(m.embed_tokens.weight)
    assert _ptr(ours.norm.weight) == _ptr(m.norm.weight)
    if c.tie_word_embeddings:
        assert ours.lm_head is None and _ptr(ref.lm_head.weight) == _ptr(m.embed_tokens.weight)
    else:
        assert _ptr(ours.lm_head.weight) == _ptr(ref.lm_head.weight)
    with torch.no_grad():
        after = ref(torch.tensor([tokens])).logits[0]
    assert _relative_error(after, before) < 1e-6              # the transformers model still works
    _check_positions(_runner(ours, case), ref, seed=4)


def test_runner_takes_a_transformers_model():
    case = CASES["phi3-window"]
    ref = hf_model(case, seed=5)
    runner = fg.FullGraphRunner(ref, max_num_seqs=4, max_num_tokens=128, max_model_len=256, cudagraph="padded",
                                attention="sdpa")
    assert isinstance(runner.model, fg.models.Llama)
    assert _ptr(runner.model.layers[0].self_attn.qkv_proj.weight) == _ptr(ref.model.layers[0].self_attn.qkv_proj.weight)
    _check_positions(runner, ref, seed=6)


# ---- refusals ------------------------------------------------------------------------------------
def _saved_config(name: str) -> dict:
    """config.json as transformers writes it for a case."""
    config = getattr(transformers, f"{CASES[name].arch}Config")(**{**BASE, **CASES[name].config})
    return json.loads(config.to_json_string())


@pytest.mark.parametrize("arch, keys", [
    ("Llama", {}), ("Mistral", {}), ("Mistral", {"sliding_window": None}),
    ("Qwen2", {}), ("Qwen2", {"use_sliding_window": True, "max_window_layers": 1}),
    ("Qwen3", {}), ("Qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),
    ("Phi3", {"pad_token_id": 0}), ("Phi3", {"pad_token_id": 0, "sliding_window": 8}),
], ids=["llama", "mistral", "mistral-null-window", "qwen2", "qwen2-window", "qwen3", "qwen3-window", "phi3",
        "phi3-window"])
def test_missing_and_null_keys_read_as_transformers_reads_them(arch, keys):
    """A minimal config.json: absent keys take each architecture's own default (Mistral: 8 KV
    heads and a 4096 window; Qwen: 32 KV heads, Qwen3 head_dim 128); a null window means none."""
    given = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=FFN, num_hidden_layers=3,
                 num_attention_heads=32, **keys)
    theirs = getattr(transformers, f"{arch}Config")(**given)
    ours = llama_config({"architectures": [f"{arch}ForCausalLM"], **given})
    layer_types = getattr(theirs, "layer_types", None) or ["sliding_attention"] * 3
    windows = [theirs.sliding_window if t == "sliding_attention" else None for t in layer_types] \
        if hasattr(theirs, "sliding_window") else [None] * 3
    assert [ours.window(i) for i in range(3)] == windows
    assert ours.num_kv_heads == theirs.num_key_value_heads
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or 512 // 32)
    assert (ours.rms_norm_eps, ours.max_position_embeddings, ours.tie_word_embeddings, ours.rope_theta) == \
        (theirs.rms_norm_eps, theirs.max_position_embeddings, theirs.tie_word_embeddings,
         theirs.rope_parameters["rope_theta"])


@pytest.mark.parametrize("name, change, field_name", [
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}, "dynamic"),
    ("llama", {"rope_parameters": {"rope_type": "fancy", "rope_theta": 10000.0}}, "fancy"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0, "beta": 1}}, "beta"),
    ("llama", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("qwen3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ("llama", {"sliding_window": 16}, "sliding_window"),
    ("llama", {"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
    ("qwen2-window", {"layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
    ("qwen2-window", {"layer_types": ["full_attention"]}, "layer_types"),
    ("qwen3", {"layer_types": ["sliding_attention", "full_attention"]}, "use_sliding_window"),
    ("phi3", {"rope_parameters": {**_longrope(64), "short_mscale": 1.1, "long_mscale": 1.2}}, "short_mscale"),
    ("phi3", {"rope_parameters": {**_longrope(64), "short_factor": [1.0] * 4}}, "factors"),
], ids=["gelu", "dynamic", "unknown-rope", "partial-llama", "partial-phi3", "rope-key", "attn-softcap",
        "final-softcap", "llama-window", "gptq", "layer-type", "layer-count", "sliding-off", "longrope-mscale",
        "longrope-length"])
def test_config_refusals(name, change, field_name):
    with pytest.raises(ValueError, match=field_name):
        llama_config({**_saved_config(name), **change})


def test_top_level_original_max_position_wins():
    """As in transformers: Phi-3's top-level ``original_max_position_embeddings`` overrides the
    rope dict's (LongRoPE's factor switch and attention factor both depend on it)."""
    config = {**_saved_config("phi3"), "original_max_position_embeddings": 128, "rope_parameters": _longrope(64)}
    theirs = transformers.Phi3Config.from_dict(config).rope_parameters["original_max_position_embeddings"]
    assert llama_config(config).rope_scaling["original_max_position_embeddings"] == theirs == 128


def test_unsupported_architecture_is_refused(tmp_path):
    config = {**_saved_config("llama"), "architectures": ["GemmaForCausalLM"], "model_type": "gemma"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="GemmaForCausalLM"):
        fg.models.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": []}))
    with pytest.raises(ValueError, match="gemma"):
        fg.models.from_pretrained(tmp_path)


def _edited_checkpoint(path: Path, edit) -> Path:
    ref = hf_model(CASES["llama"])
    ref.save_pretrained(path)
    file = path / "model.safetensors"
    tensors = safetensors_torch.load_file(str(file))
    edit(tensors)
    safetensors_torch.save_file(tensors, str(file), metadata={"format": "pt"})
    return path


KV_ROWS = KV_HEADS * HIDDEN // HEADS


@pytest.mark.parametrize("tensor, shape, expected", [
    ("model.norm.weight", (HIDDEN + 1,), (HIDDEN,)),
    ("model.layers.1.mlp.down_proj.weight", (HIDDEN, FFN + 2), (HIDDEN, FFN)),
    ("model.layers.0.self_attn.k_proj.weight", (KV_ROWS, HIDDEN - 1), (KV_ROWS, HIDDEN)),   # fused with q, v
    ("model.layers.0.self_attn.v_proj.weight", (KV_ROWS + 1, HIDDEN), (KV_ROWS, HIDDEN)),
    ("model.layers.1.mlp.up_proj.weight", (FFN - 1, HIDDEN), (FFN, HIDDEN)),
])
def test_wrong_shape_names_tensor_and_shapes(tmp_path, tensor, shape, expected):
    path = _edited_checkpoint(tmp_path, lambda sd: sd.__setitem__(tensor, torch.randn(shape)))
    with pytest.raises(ValueError, match=re.escape(f"{tensor}: checkpoint {shape} vs model {expected}")):
        fg.models.from_pretrained(path)


@pytest.mark.parametrize("tensor", ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight",
                                    "model.layers.1.mlp.up_proj.weight", "lm_head.weight"])
def test_missing_tensor_is_named(tmp_path, tensor):
    path = _edited_checkpoint(tmp_path, lambda sd: sd.pop(tensor))
    with pytest.raises(ValueError, match=re.escape(tensor)):
        fg.models.from_pretrained(path)


# ---- on a GPU: captured graphs equal eager steps -------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_full_graph_equals_eager_on_cuda(checkpoint, name):
    _, path, _ = checkpoint(name)
    case = CASES[name]
    model = fg.models.from_pretrained(path, device="cuda", max_model_len=case.max_model_len)
    tokens = _tokens(PARITY_LEN, seed=7)
    logits = {}
    for mode in ("none", "full"):
        runner = fg.FullGraphRunner(model, max_num_seqs=4, max_num_tokens=128, max_model_len=case.max_model_len,
                                    cudagraph=mode)
        blocks = runner.blocks.allocate(-(-PARITY_LEN // runner.config.block_size))
        logits[mode] = torch.stack([runner.step([fg.SeqChunk(tokens[s:e], s, blocks)]).logits[0]
                                    for s, e in SCHEDULE]).cpu()
        if mode == "full":
            assert runner.stats()["graph_hits"], "no step replayed a captured graph"
    for row, (_, end) in enumerate(SCHEDULE):
        err = _relative_error(logits["full"][row], logits["none"][row])
        assert err < 1e-4, f"position {end - 1}: relative error {err:.2e}"
