"""A tensor-parallel rank reads only its shard of a safetensors checkpoint (CPU, no process group).

``from_pretrained(path, tensor_parallel=tp)`` must build exactly the model that loading the whole
checkpoint and ``shard_model`` give (every parameter bit for bit, every rank), while reading the
sharded tensors through slices, never whole; ``shard_model`` itself is checked against one
process over gloo in ``test_parallel.py``.
"""
from __future__ import annotations

import json

import pytest
import torch

import fullgraph as fg
from fullgraph.models import Phi3Small, Phi3SmallConfig
from fullgraph.models import loading
from fullgraph.parallel import TensorParallel, shard_model
from test_phi3_small import hf_config as phi3_small_hf_config, hf_state_dict as phi3_small_hf_state

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
from safetensors.torch import save_file  # noqa: E402

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=128)
SHARDED_WEIGHTS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "qkv_proj.weight", "o_proj.weight",
                   "gate_proj.weight", "up_proj.weight", "gate_up_proj.weight", "down_proj.weight",
                   "query_key_value.weight", "dense.weight", "embed_tokens.weight", "lm_head.weight")


def _hf_checkpoint(path, arch: str, max_shard_size: str | None = None, **changes):
    config = getattr(transformers, f"{arch}Config")(**{**BASE, **changes})
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():   # norms and biases never 1 and 0: a miswired one shows
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.2)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return path


def _phi3_small_checkpoint(path):
    model = Phi3Small(Phi3SmallConfig.toy(), seed=1)
    (path / "config.json").write_text(json.dumps(phi3_small_hf_config(model.config)))
    sd = phi3_small_hf_state(model)
    names = sorted(sd)
    save_file({k: sd[k].contiguous() for k in names[::2]}, str(path / "model-00001-of-00002.safetensors"))
    save_file({k: sd[k].contiguous() for k in names[1::2]}, str(path / "model-00002-of-00002.safetensors"))
    return path


@pytest.fixture
def reads(monkeypatch):
    """Every tensor the loader reads from a file: name -> 'whole' or 'slice'."""
    seen: dict[str, str] = {}
    real = safetensors.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self._f = real(*args, **kwargs)

        def __enter__(self):
            self._inner = self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def keys(self):
            return self._inner.keys()

        def get_tensor(self, name):
            seen[name] = "whole"
            return self._inner.get_tensor(name)

        def get_slice(self, name):
            seen[name] = "slice"
            return self._inner.get_slice(name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    return seen


def _same_model(sliced, reference) -> None:
    a = dict(sliced.named_parameters(remove_duplicate=False))
    b = dict(reference.named_parameters(remove_duplicate=False))
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].shape == b[name].shape and torch.equal(a[name], b[name]), name
    for x, y in zip(sliced.layers, reference.layers):
        got, want = x.self_attn.attn, y.self_attn.attn
        assert (got.num_heads, got.num_kv_heads, got.sparse) == (want.num_heads, want.num_kv_heads, want.sparse)
        assert getattr(x.self_attn, "q_size", None) == getattr(y.self_attn, "q_size", None)
    assert sliced.tensor_parallel == reference.tensor_parallel


CASES = {  # name -> (checkpoint writer, world sizes); 8 query heads over 2 KV heads: 4 ranks replicate them
    "llama-sharded-files": (lambda p: _hf_checkpoint(p, "Llama", "40KB", attention_bias=True, mlp_bias=True), (2, 4)),
    "llama-tied": (lambda p: _hf_checkpoint(p, "Llama", tie_word_embeddings=True), (2, 4)),
    "phi3-fused": (lambda p: _hf_checkpoint(p, "Phi3", pad_token_id=0, bos_token_id=1, eos_token_id=2), (2, 4)),
    "qwen2-qkv-bias": (lambda p: _hf_checkpoint(p, "Qwen2"), (2,)),
    "phi3-small": (_phi3_small_checkpoint, (2, 4)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rank_reads_only_its_slices(tmp_path, case, reads):
    write, worlds = CASES[case]
    path = write(tmp_path)
    whole = fg.models.from_pretrained(path)
    for world in worlds:
        for rank in range(world):
            tp = TensorParallel(rank, world, None)
            reads.clear()
            sliced = fg.models.from_pretrained(path, tensor_parallel=tp)
            how = dict(reads)
            reference = shard_model(fg.models.from_pretrained(path), tp)   # the whole checkpoint, then sliced
            _same_model(sliced, reference)
            sharded = [n for n in how if n.endswith(SHARDED_WEIGHTS)]
            assert len(sharded) >= 5 and all(how[n] == "slice" for n in sharded), \
                {n: how[n] for n in sharded if how[n] != "slice"}
            assert all(v == "whole" for n, v in how.items() if "norm" in n)
    assert getattr(whole, "tensor_parallel", None) is None


def test_bytes_read_shrink_with_the_ranks(tmp_path, monkeypatch):
    """Each of 4 ranks reads about a quarter of the sharded weights (the norms whole)."""
    path = _hf_checkpoint(tmp_path, "Llama")
    read = []
    real = loading._read_cut

    def counting(*args):
        t = real(*args)
        read.append(t.numel())
        return t
    monkeypatch.setattr(loading, "_read_cut", counting)
    fg.models.from_pretrained(path, tensor_parallel=TensorParallel(1, 4, None))
    whole = fg.models.from_pretrained(path)
    total = sum(p.numel() for n, p in whole.named_parameters() if "norm" not in n)
    # the KV heads are replicated at 4 ranks: k and v read a half each, everything else a quarter
    assert total / 4 <= sum(read) <= total / 2


def test_wrong_full_shape_is_refused_by_name(tmp_path):
    path = _hf_checkpoint(tmp_path, "Llama")
    file = path / "model.safetensors"
    tensors = safetensors.torch.load_file(str(file))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = torch.cat([tensors[name], tensors[name][:, :8]], dim=1)   # 8 columns too many
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight has shape \(64, 104\), the "
                                         r"model expects \(64, 96\)"):
        fg.models.from_pretrained(path, tensor_parallel=TensorParallel(0, 2, None))
