"""Write an attention backend against the public interface, then prove it with the conformance suite.

``NaivePaged`` is plain PyTorch over the paged KV cache: every new token gathers its request's pages
through ``block_table`` and attends, masked, to the keys its position may see. The layer has already
written this step's keys into the cache (``kv_write = "auto"``: our Triton write on CUDA, plain
PyTorch elsewhere), so ``forward`` only attends. It reads no host value and allocates nothing whose
size depends on tensor values, so it is capture-safe; the suite checks that in every mode.
"""
import sys

import torch

import fullgraph as fg
from fullgraph import testing


class NaivePaged(fg.attention.AttentionBackend):
    name = "naive_paged"
    policy = fg.PaddingPolicy("naive_paged", reads=frozenset({"query_start_loc", "seq_lens", "block_table",
                                                               "slot_mapping"}))

    def forward(self, layer, q, k, v, kv_cache, metadata):
        # q: (T, H, D); kv_cache: (2, num_blocks, block_size, KVH, D) -> (T, H, D)
        qsl = metadata.require("query_start_loc", self.name)
        seq_lens = metadata.require("seq_lens", self.name)
        table = metadata.require("block_table", self.name)
        num_tokens, num_reqs = q.shape[0], table.shape[0]
        tok = torch.arange(num_tokens, device=q.device)
        req = torch.searchsorted(qsl[1:], tok.to(qsl.dtype), right=True).clamp(max=num_reqs - 1)   # (T,)
        pos = seq_lens[req] - (qsl[req + 1] - tok)                  # each token's position in its request
        real = tok < qsl[-1]                                       # padded tokens sit past the last offset
        kv = kv_cache[:, table[req]].flatten(2, 3)                 # (2, T, L, KVH, D): the request's keys
        key_pos = torch.arange(kv.shape[2], device=q.device)
        see = (key_pos[None] <= pos[:, None]) & (key_pos[None] < seq_lens[req][:, None]) & real[:, None]
        if layer.sliding_window:
            see &= key_pos[None] > pos[:, None] - layer.sliding_window
        see[:, 0] |= ~see.any(-1)                                  # never an empty row (padding: key 0)
        kv = torch.where(see[None, :, :, None, None], kv, 0.0)    # stale or poisoned slots never count
        group = layer.num_heads // layer.num_kv_heads
        keys, values = (x.repeat_interleave(group, dim=2).float() for x in kv)   # (T, L, H, D)
        scores = torch.einsum("thd,tlhd->thl", q.float(), keys) * layer.scale
        scores = scores.masked_fill(~see[:, None, :], float("-inf"))
        out = torch.einsum("thl,tlhd->thd", scores.softmax(-1), values)
        return torch.where(real[:, None, None], out, 0.0).to(q.dtype)


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = testing.conformance(backend=NaivePaged, device=device, modes=None if device == "cuda" else ["padded"])
    print(report.table())
    sys.exit(0 if report.ok else 1)
