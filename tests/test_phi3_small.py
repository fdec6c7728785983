"""Phi-3-Small against an independent float64 reference written here from PHI3_SMALL.md.

The reference reads the checkpoint-named state dict and the ``config.json``-style dict only: its
own QKV split, RoPE / LongRoPE, LayerNorm calls, GeGeLU with the clamp, and block-sparse attention
from the KEEP rule as a dense mask over whole sequences. The model runs through the runner
(``cudagraph="none"`` and ``"padded"``; ``"full"`` on a GPU) and is compared token by token.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

import fullgraph as fg
from fullgraph.models.phi3_small import LongRopeScaling, Phi3Small, Phi3SmallConfig, gegelu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOY_WINDOW = 64  # toy: 4 local blocks x 16 tokens


# ---- the checkpoint view of a model ------------------------------------------------------------
def hf_config(c: Phi3SmallConfig) -> dict:
    """A config.json as the checkpoints spell it (plus the keys fullgraph ignores)."""
    out = {"architectures": ["Phi3SmallForCausalLM"], "model_type": "phi3small", "hidden_act": "gegelu",
           "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
           "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
           "ff_intermediate_size": c.ff_intermediate_size, "ff_dim_multiplier": None, "gegelu_limit": c.gegelu_limit,
           "gegelu_pad_to_256": True, "layer_norm_epsilon": c.layer_norm_epsilon,
           "rope_embedding_base": c.rope_embedding_base, "rope_position_scale": 1.0,
           "max_position_embeddings": c.max_position_embeddings, "rope_scaling": None,
           "mup_use_scaling": True, "mup_attn_multiplier": c.mup_attn_multiplier,
           "mup_embedding_multiplier": c.mup_embedding_multiplier, "mup_width_multiplier": c.mup_width_multiplier,
           "dense_attention_every_n_layers": c.dense_attention_every_n_layers,
           "blocksparse_block_size": c.blocksparse_block_size,
           "blocksparse_num_local_blocks": c.blocksparse_num_local_blocks,
           "blocksparse_vert_stride": c.blocksparse_vert_stride,
           "blocksparse_homo_head_pattern": c.blocksparse_homo_head_pattern,
           "blocksparse_triton_kernel_block_size": c.blocksparse_block_size, "embedding_dropout_prob": 0.1,
           "tie_word_embeddings": True, "bos_token_id": 100257, "eos_token_id": 100257, "torch_dtype": "bfloat16",
           "dummy_token_indices": list(c.dummy_token_ids)}
    if c.rope_scaling is not None:
        r = c.rope_scaling
        out["rope_scaling"] = {"type": "su", "short_factor": list(r.short_factor), "long_factor": list(r.long_factor),
                               "original_max_position_embeddings": r.original_max_position_embeddings,
                               "short_mscale": r.short_mscale, "long_mscale": r.long_mscale}
    return out


def checkpoint_names(num_layers: int) -> set[str]:
    names = {"model.embed_tokens.weight", "model.final_layernorm.weight", "model.final_layernorm.bias"}
    for i in range(num_layers):
        for part in ("input_layernorm", "self_attn.query_key_value", "self_attn.dense", "post_attention_layernorm",
                     "mlp.up_proj", "mlp.down_proj"):
            names |= {f"model.layers.{i}.{part}.weight", f"model.layers.{i}.{part}.bias"}
    return names


def hf_state_dict(model: Phi3Small) -> dict[str, torch.Tensor]:
    return {"model." + k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


# ---- the reference ---------------------------------------------------------------------------
def reference_logits(sd: dict[str, torch.Tensor], hf: dict, ids: list[int], *, long_rope: bool = False,
                     all_dense: bool = False) -> torch.Tensor:
    """(len(ids), vocab) float64 logits of every position of one whole sequence."""
    w = {k: v.double() for k, v in sd.items()}
    hidden, nh, nkv = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
    d, g, n, eps = hidden // nh, nh // nkv, len(ids), hf["layer_norm_epsilon"]
    inv_freq = 1.0 / hf["rope_embedding_base"] ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    mscale, rs = 1.0, hf["rope_scaling"]
    if rs:
        orig, max_pos = rs["original_max_position_embeddings"], hf["max_position_embeddings"]
        inv_freq = inv_freq / torch.tensor(rs["long_factor" if long_rope else "short_factor"], dtype=torch.float64)
        given = rs["long_mscale" if long_rope else "short_mscale"]
        default = math.sqrt(1 + math.log(max_pos / orig) / math.log(orig)) if long_rope else 1.0
        mscale = default if given is None else given
    angle = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None]          # (n, d/2)
    cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None], torch.cat([angle.sin()] * 2, -1)[:, None]

    def rope(t):  # (n, heads, d), rotate-half over all dims, then mscale
        rotated = torch.cat((-t[..., d // 2:], t[..., : d // 2]), -1)
        return (t * cos + rotated * sin) * mscale

    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    causal = j <= i
    bs, local, stride = hf["blocksparse_block_size"], hf["blocksparse_num_local_blocks"], hf["blocksparse_vert_stride"]
    step = 0 if hf["blocksparse_homo_head_pattern"] else max(1, stride // nh)
    heads = torch.arange(nh)[:, None, None]
    sparse = causal & (((i // bs - j // bs) < local) | ((j // bs + heads * step + 1) % stride == 0))  # (nh, n, n)
    limit = hf["gegelu_limit"]
    x = w["model.embed_tokens.weight"][ids] * hf["mup_embedding_multiplier"]
    for layer in range(hf["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        a = F.layer_norm(x, (hidden,), w[p + "input_layernorm.weight"], w[p + "input_layernorm.bias"], eps)
        qkv = F.linear(a, w[p + "self_attn.query_key_value.weight"], w[p + "self_attn.query_key_value.bias"])
        qkv = qkv.view(n, nkv, g + 2, d)                     # per KV group: g queries, then k, then v
        q, k, v = rope(qkv[:, :, :g].reshape(n, nh, d)), rope(qkv[:, :, g]), qkv[:, :, g + 1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)   # query head h -> kv head h // g
        dense = all_dense or (layer + 1) % hf["dense_attention_every_n_layers"] == 0
        scores = torch.einsum("ihd,jhd->hij", q, k) * (hf["mup_attn_multiplier"] / d)
        scores = scores.masked_fill(~(causal if dense else sparse), float("-inf"))
        o = torch.einsum("hij,jhd->ihd", scores.softmax(-1), v).reshape(n, nh * d)
        x = x + F.linear(o, w[p + "self_attn.dense.weight"], w[p + "self_attn.dense.bias"])
        a = F.layer_norm(x, (hidden,), w[p + "post_attention_layernorm.weight"], w[p + "post_attention_layernorm.bias"],
                         eps)
        u = F.linear(a, w[p + "mlp.up_proj.weight"], w[p + "mlp.up_proj.bias"])
        gate, lin = u[:, 0::2], u[:, 1::2]
        gate = torch.where(gate.isinf(), gate, torch.minimum(gate, torch.tensor(limit, dtype=gate.dtype)))
        lin = torch.where(lin.isinf(), lin, lin.clamp(-limit, limit))
        x = x + F.linear(gate * torch.sigmoid(1.702 * gate) * (lin + 1), w[p + "mlp.down_proj.weight"],
                         w[p + "mlp.down_proj.bias"])
    x = F.layer_norm(x, (hidden,), w["model.final_layernorm.weight"], w["model.final_layernorm.bias"], eps)
    logits = x @ w["model.embed_tokens.weight"].T / hf["mup_width_multiplier"]
    logits[:, hf["dummy_token_indices"]] = float("-inf")
    return logits


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-4) -> None:
    actual, expected = actual.double().cpu(), expected.double().cpu()
    assert torch.equal(torch.isinf(actual), torch.isinf(expected)), "-inf (dummy id) positions differ"
    finite = torch.isfinite(expected)
    err = (actual[finite] - expected[finite]).abs().max().item()
    scale = expected[finite].abs().max().item()
    assert err <= rtol * scale, f"max error {err:.3g} > {rtol:g} x logit scale {scale:.3g}"


# ---- driving the runner ----------------------------------------------------------------------
class Session:
    """Runs steps of several requests through a runner; keeps each request's tokens and logits."""

    def __init__(self, runner: fg.FullGraphRunner) -> None:
        self.runner, self.tokens, self.logits, self.blocks, self.script = runner, {}, {}, {}, []

    def step(self, work: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        chunks = []
        for rid, toks in work.items():
            if rid not in self.blocks:
                cfg = self.runner.config
                self.blocks[rid] = self.runner.blocks.allocate(cfg.max_model_len // cfg.block_size)
            seq = self.tokens.setdefault(rid, [])
            chunks.append(fg.SeqChunk(token_ids=toks, start_pos=len(seq), block_ids=self.blocks[rid], request_id=rid))
            seq.extend(toks)
        out = self.runner.step(chunks)
        self.script.append(work)
        assert out.logits.shape == (len(work), self.runner.vocab_size) and out.logits.dtype == torch.float32
        rows = dict(zip(work, out.logits))
        for rid, row in rows.items():
            self.logits.setdefault(rid, {})[len(self.tokens[rid]) - 1] = row
        return rows

    def greedy(self, rows: dict[str, torch.Tensor]) -> dict[str, list[int]]:
        return {rid: [int(row.argmax())] for rid, row in rows.items()}

    def check(self, model: Phi3Small, **ref_kwargs) -> None:
        sd, hf = hf_state_dict(model), hf_config(model.config)
        for rid, by_pos in self.logits.items():
            ref = reference_logits(sd, hf, self.tokens[rid], **ref_kwargs)
            for pos, row in by_pos.items():
                assert_logits_close(row, ref[pos])


def make_runner(model: Phi3Small, mode: str, max_model_len: int = 320, **kw) -> fg.FullGraphRunner:
    return fg.FullGraphRunner(model, cudagraph=mode, attention="sdpa", max_num_seqs=4, max_num_tokens=256,
                              max_model_len=max_model_len, block_size=16, validate=mode != "none", **kw)


def prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def toy() -> Phi3Small:
    return Phi3Small(Phi3SmallConfig.toy(), seed=1)


# ---- end to end against the reference --------------------------------------------------------
@pytest.mark.parametrize("mode", ["none", "padded"])
@pytest.mark.parametrize("prompt_len, cuts, decodes", [
    (56, [56], 10),                  # shorter than the 64-token window; decode crosses it (scenario 17)
    (200, [37, 101, 200], 2),        # longer; chunks start mid sparse block (scenario 19)
])
def test_runner_matches_reference(toy, mode, prompt_len, cuts, decodes):
    s = Session(make_runner(toy, mode))
    ids, start = prompt(prompt_len, seed=prompt_len), 0
    for cut in cuts:
        rows = s.step({"a": ids[start:cut]})
        start = cut
    for _ in range(decodes):
        rows = s.step(s.greedy(rows))
    assert len(s.tokens["a"]) == prompt_len + decodes
    s.check(toy)


def test_mixed_prefill_and_decode_batch(toy):
    s = Session(make_runner(toy, "padded"))
    a, b, c = prompt(150, 1), prompt(90, 2), prompt(5, 3)
    rows = s.step({"a": a[:75], "b": b})                 # two prefills; 75 is mid block
    rows = s.step({"a": a[75:], "b": s.greedy(rows)["b"], "c": c})
    for _ in range(2):
        rows = s.step(s.greedy(rows))                    # decode-only steps of three requests
    s.check(toy)


def test_sparse_equals_dense_within_window_and_differs_beyond(toy):
    sd, hf, ids = hf_state_dict(toy), hf_config(toy.config), prompt(160, 7)
    sparse, dense = reference_logits(sd, hf, ids), reference_logits(sd, hf, ids, all_dense=True)
    finite = torch.isfinite(dense)
    assert torch.allclose(sparse[:TOY_WINDOW][finite[:TOY_WINDOW]], dense[:TOY_WINDOW][finite[:TOY_WINDOW]],
                          rtol=0, atol=1e-12)
    beyond = (sparse[TOY_WINDOW:] - dense[TOY_WINDOW:])[finite[TOY_WINDOW:]].abs().max().item()
    # The pattern matters past the window, so the runner tests (which match the sparse reference
    # beyond it) would catch a silent dense fallback (scenario 18).
    assert beyond > 1e-2 * dense[finite].abs().max().item()


def test_layers_alternate_and_sparse_layers_use_global_heads(toy):
    c = toy.config
    layers = toy.attention_layers()
    assert [layer.kind for layer in layers] == ["blocksparse", "dense", "blocksparse", "dense"]
    for layer in layers:
        assert layer.scale == pytest.approx(c.mup_attn_multiplier / c.head_dim)
        assert (layer.num_heads, layer.num_kv_heads, layer.head_dim) == (8, 2, 16)
    for layer in layers[::2]:
        sp = layer.sparse
        assert (sp.num_heads_total, sp.head_offset, sp.block_size, sp.local_blocks, sp.vert_stride, sp.homo_head) \
            == (c.num_attention_heads, 0, 16, 4, 4, False)
    # Heads of one KV group get different vertical offsets (the global index times step 1).
    keep = layers[0].sparse.keep(8, torch.tensor([[200]]), torch.arange(0, 200, 16)[None])   # (8, 1, 13)
    assert len({tuple(keep[h, 0].tolist()) for h in range(4)}) == 4
    assert torch.equal(keep[0], keep[4])
    # A rank holding heads 4..7 (head_offset 4) must see exactly the pattern of global heads 4..7.
    rank1 = dataclasses.replace(layers[0].sparse, head_offset=4)
    assert torch.equal(rank1.keep(4, torch.tensor([[200]]), torch.arange(0, 200, 16)[None]), keep[4:])


def test_real_shapes_scale_and_dummy_ids():
    c = Phi3SmallConfig.phi3_small_8k()
    assert (c.head_dim, c.attn_scale, c.ff_intermediate_size) == (128, 1 / 128, 14336)
    ids = set(c.dummy_token_ids)
    assert len(ids) == 91 and {100256, 100258, 100260, 100264, 100276, 100351} <= ids
    assert not ids & {100257, 100266, 100261}
    assert c.sparse_config().head_step == 1
    model = Phi3Small(c, dtype=torch.bfloat16, device="meta", seed=None)     # shapes only, no memory
    assert sum(p.numel() for p in model.parameters()) == 7_392_272_384       # 7.39e9, embeddings tied
    assert model.rope_factors is None and model.rotary.cos.shape == (8192, 64)


def test_dummy_ids_are_minus_inf(toy):
    hidden = torch.randn(3, toy.config.hidden_size, generator=torch.Generator().manual_seed(0))
    logits = toy.compute_logits(hidden)
    dummy = torch.zeros(toy.vocab_size, dtype=torch.bool)
    dummy[list(toy.config.dummy_token_ids)] = True
    assert logits.dtype == torch.float32
    assert torch.isneginf(logits[:, dummy]).all() and torch.isfinite(logits[:, ~dummy]).all()
    expected = (hidden @ toy.embed_tokens.weight.T) / 8.0
    torch.testing.assert_close(logits[:, ~dummy], expected[:, ~dummy])


# ---- GeGeLU --------------------------------------------------------------------------------
def test_gegelu_clamp_passes_infinities():
    inf = float("inf")
    gate = torch.tensor([inf, -inf, 25.0, -25.0, 1.5, inf, 3.0])
    lin = torch.tensor([0.5, 0.5, 30.0, -30.0, -0.5, -inf, inf])
    u = torch.stack((gate, lin), -1).reshape(1, -1)          # interleaved [gate0, lin0, gate1, lin1, ...]
    out = gegelu(u, 20.0)[0]

    def expected(a, b):
        a = a if math.isinf(a) else min(a, 20.0)
        b = b if math.isinf(b) else max(-20.0, min(b, 20.0))
        sig = 1.0 if a == inf else 0.0 if a == -inf else 1 / (1 + math.exp(-1.702 * a))
        return a * sig * (b + 1)

    want = torch.tensor([expected(a, b) for a, b in zip(gate.tolist(), lin.tolist())])
    torch.testing.assert_close(out, want, equal_nan=True)
    assert out[0] == inf and out[5] == -inf and out[6] == inf    # infinities were not capped at 20
    assert torch.clamp(torch.tensor(inf), max=20.0) == 20.0      # why the model cannot use clamp alone


def test_toy_weights_hit_the_gegelu_clamp(toy):
    layer = toy.layers[0]
    x = toy.embed_tokens(torch.tensor(prompt(50, 9))) * toy.config.mup_embedding_multiplier
    with torch.no_grad():
        u = layer.mlp.up_proj(layer.post_attention_layernorm(x))
    assert u.abs().max() > toy.config.gegelu_limit     # so the end-to-end tests exercise the clamp


# ---- LongRoPE ------------------------------------------------------------------------------
def longrope_toy(**mscales) -> Phi3SmallConfig:
    short = tuple(1.0 + 0.05 * i for i in range(8))
    long = tuple(1.0 + 2.0 * i for i in range(8))
    return dataclasses.replace(Phi3SmallConfig.toy(), rope_scaling=LongRopeScaling(short, long, 128, **mscales))


@pytest.mark.parametrize("max_model_len, factors, mscales", [
    (128, "short", {}), (512, "long", {}), (512, "long", {"short_mscale": 1.1, "long_mscale": 1.3}),
])
def test_longrope_choice_is_fixed_at_construction(max_model_len, factors, mscales):
    model = Phi3Small(longrope_toy(**mscales), seed=2, max_model_len=max_model_len)
    assert model.rope_factors == factors
    s = Session(make_runner(model, "padded", max_model_len=max_model_len))
    rows = s.step({"a": prompt(90, 4)})           # long factors apply below 128 tokens too: one rotation
    s.step(s.greedy(rows))
    s.check(model, long_rope=factors == "long")
    other = reference_logits(hf_state_dict(model), hf_config(model.config), s.tokens["a"], long_rope=factors != "long")
    finite = torch.isfinite(other[-1])
    assert (other[-1] - s.logits["a"][90].double())[finite].abs().max() > 1e-3 * other[-1][finite].abs().max()


# ---- configs and checkpoints ---------------------------------------------------------------
def test_from_hf_reads_the_checkpoint_config():
    hf8 = hf_config(Phi3SmallConfig.phi3_small_8k())
    del hf8["dummy_token_indices"]                 # real config.json has none: the tokenizer's ids are used
    assert Phi3SmallConfig.from_hf(hf8) == Phi3SmallConfig.phi3_small_8k()
    long = [1.0 + i / 8 for i in range(64)]
    hf128 = {**hf8, "max_position_embeddings": 131072, "rope_scaling": {
        "type": "longrope", "short_factor": [1.0] * 64, "long_factor": long,
        "original_max_position_embeddings": 8192, "short_mscale": 1.0, "long_mscale": 1.19}}
    c = Phi3SmallConfig.from_hf(hf128)
    assert c.rope_scaling == LongRopeScaling((1.0,) * 64, tuple(long), 8192, 1.0, 1.19)
    assert c.max_position_embeddings == 131072
    assert Phi3SmallConfig.phi3_small_128k().rope_scaling.original_max_position_embeddings == 8192
    for bad in ({"rope_position_scale": 2.0}, {"hidden_act": "gelu"}, {"tie_word_embeddings": False},
                {"rope_scaling": {"type": "linear", "factor": 2.0}}):
        with pytest.raises(ValueError):
            Phi3SmallConfig.from_hf({**hf8, **bad})
    with pytest.raises(ValueError, match="num_hidden_layers"):
        Phi3SmallConfig.from_hf({k: v for k, v in hf8.items() if k != "num_hidden_layers"})


@pytest.mark.parametrize("changes, match", [
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"dummy_token_ids": (512,)}, "dummy_token_ids"),
    ({"rope_scaling": LongRopeScaling((1.0,) * 4, (1.0,) * 4, 64)}, "factors"),
    ({"blocksparse_block_size": 24}, "power of two"),
    ({"gegelu_limit": -1.0}, "gegelu_limit"),
])
def test_config_validation(changes, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(Phi3SmallConfig.toy(), **changes)


def write_checkpoint(path, model: Phi3Small, sd: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    (path / "config.json").write_text(json.dumps(hf_config(model.config)))
    names = sorted(sd)
    save_file({k: sd[k].contiguous() for k in names[::2]}, str(path / "model-00001-of-00002.safetensors"))
    save_file({k: sd[k].contiguous() for k in names[1::2]}, str(path / "model-00002-of-00002.safetensors"))


def test_from_pretrained_round_trip(tmp_path, toy):
    pytest.importorskip("safetensors")
    sd = hf_state_dict(toy)
    assert set(sd) == checkpoint_names(4)
    assert sd["model.layers.0.self_attn.query_key_value.weight"].shape == ((8 + 2 * 2) * 16, 128)
    assert sd["model.layers.0.mlp.up_proj.weight"].shape == (2 * 128, 128)
    write_checkpoint(tmp_path, toy, sd)
    loaded = Phi3Small.from_pretrained(tmp_path)
    assert loaded.config == toy.config
    ids = prompt(20, 5)
    out = [Session(make_runner(m, "none")).step({"a": ids})["a"] for m in (toy, loaded)]
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)


@pytest.mark.parametrize("edit, match", [
    (lambda sd: sd.pop("model.layers.1.mlp.down_proj.bias"), "model.layers.1.mlp.down_proj.bias"),
    (lambda sd: sd.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(1)}), "q_proj"),
    (lambda sd: sd.update({"model.final_layernorm.bias": torch.zeros(3)}), "final_layernorm.bias"),
])
def test_loading_is_strict(toy, edit, match):
    sd = hf_state_dict(toy)
    edit(sd)
    model = Phi3Small(toy.config, seed=None)
    with pytest.raises(ValueError, match=match):
        model.load_hf_state_dict(sd)


def test_tied_lm_head_in_checkpoint_is_ignored(toy):
    sd = {**hf_state_dict(toy), "lm_head.weight": torch.zeros(512, 128)}
    model = Phi3Small(toy.config, seed=None)
    model.load_hf_state_dict(sd)
    assert torch.equal(model.embed_tokens.weight, toy.embed_tokens.weight)


# ---- GPU -----------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
def test_toy_full_graph_equals_eager():
    model = Phi3Small(Phi3SmallConfig.toy(), seed=3, device="cuda")
    eager = Session(make_runner(model, "none"))
    a, b = prompt(150, 11), prompt(70, 12)
    rows = eager.step({"a": a[:75], "b": b})
    rows = eager.step({"a": a[75:], "b": eager.greedy(rows)["b"]})
    for _ in range(4):
        rows = eager.step(eager.greedy(rows))
    graph = Session(make_runner(model, "full"))
    for work in eager.script:                      # the same steps, replayed from CUDA graphs
        graph.step(work)
    assert sum(graph.runner.stats()["graph_hits"].values()) == len(eager.script)
    for rid, by_pos in eager.logits.items():
        for pos, row in by_pos.items():
            assert_logits_close(graph.logits[rid][pos], row)
    eager.check(model)


@pytest.mark.gpu
@needs_cuda
def test_phi3_small_8k_bf16_capture_and_replay():
    """The real 8K shape, random bf16 weights: a 4K prompt in four 1K chunks, then decode steps far
    past the 1024-token local window, replayed from CUDA graphs and equal to padded eager."""
    model = Phi3Small(Phi3SmallConfig.phi3_small_8k(), dtype=torch.bfloat16, device="cuda", seed=0)
    kw = dict(max_num_seqs=2, max_num_tokens=1024, max_model_len=4096 + 64, capture_sizes=(1, 2, 1024))
    graph = Session(fg.FullGraphRunner(model, cudagraph="full", **kw))
    assert graph.runner.capture().num_graphs >= 3
    ids = prompt(4096, 13, vocab=100000)
    for start in range(0, 4096, 1024):
        rows = graph.step({"a": ids[start:start + 1024]})
    for _ in range(6):
        rows = graph.step(graph.greedy(rows))
    assert graph.runner.stats()["graph_hits"] == {(1024, False): 4, (1, True): 6}
    eager = Session(fg.FullGraphRunner(model, cudagraph="padded", **kw))
    for work in graph.script:
        eager.step(work)
    dummy = model.dummy_mask.cpu()
    for pos, row in graph.logits["a"].items():
        row = row.cpu()
        assert torch.isfinite(row[~dummy]).all() and torch.isneginf(row[dummy]).all(), f"position {pos}"
        assert_logits_close(row, eager.logits["a"][pos], rtol=2e-2)
