"""StaticBuffers: the persistent, max-size device buffers a captured graph reads.

Allocated once; their addresses never change (a graph replays raw pointers). ``copy_in`` is the
only writer: it fills a host staging area with the padded plan and moves it to the device in two
copies (one int64 group, one int32 group). On a CPU device the staging area *is* the buffer.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .config import RunnerConfig
from .plan import StepPlan

_INT64 = ("input_ids", "positions", "slot_mapping", "logits_indices")
_INT32 = ("query_start_loc", "seq_start_loc", "seq_lens", "block_table")


@dataclass
class BufferViews:
    """Views of the static buffers sized to one bucket (T tokens, R requests)."""

    input_ids: torch.Tensor        # (T,)
    positions: torch.Tensor        # (T,)
    slot_mapping: torch.Tensor     # (T,)
    logits_indices: torch.Tensor   # (R,)
    query_start_loc: torch.Tensor  # (R + 1,)
    seq_start_loc: torch.Tensor    # (R + 1,)
    seq_lens: torch.Tensor         # (R,)
    block_table: torch.Tensor      # (R, MB)
    logits: torch.Tensor           # (R, vocab) float32, the graph's output


def _layout(config: RunnerConfig) -> dict[str, tuple[int, int, tuple[int, ...]]]:
    """field -> (offset, numel, shape) inside its dtype group."""
    t, r, mb = config.max_num_tokens, config.max_num_seqs, config.max_blocks_per_seq
    shapes = {"input_ids": (t,), "positions": (t,), "slot_mapping": (t,), "logits_indices": (r,),
              "query_start_loc": (r + 1,), "seq_start_loc": (r + 1,), "seq_lens": (r,), "block_table": (r, mb)}
    out = {}
    for group in (_INT64, _INT32):
        offset = 0
        for name in group:
            numel = int(np.prod(shapes[name]))
            out[name] = (offset, numel, shapes[name])
            offset += numel
    return out


class StaticBuffers:
    """Max-size step inputs and the logits output, at fixed addresses on ``device``."""

    def __init__(self, config: RunnerConfig, vocab_size: int, device: torch.device) -> None:
        self.config, self.device = config, torch.device(device)
        self._layout = _layout(config)
        sizes = {g: sum(self._layout[n][1] for n in names) for g, names in (("i64", _INT64), ("i32", _INT32))}
        self._dev = {"i64": torch.zeros(sizes["i64"], dtype=torch.int64, device=self.device),
                     "i32": torch.zeros(sizes["i32"], dtype=torch.int32, device=self.device)}
        on_cuda = self.device.type == "cuda"
        self._host = {g: torch.zeros_like(t, device="cpu").pin_memory() if on_cuda else t for g, t in self._dev.items()}
        self._host_np = {g: t.numpy() for g, t in self._host.items()}
        self._copied = torch.cuda.Event() if on_cuda else None
        self.tensors = {name: self._view(self._dev, name) for name in _INT64 + _INT32}
        self._staging = [(name, self._view(self._host_np, name)) for name in _INT64 + _INT32]
        self.logits = torch.zeros(config.max_num_seqs, vocab_size, dtype=torch.float32, device=self.device)

    def _view(self, groups: dict, name: str):
        offset, numel, shape = self._layout[name]
        group = groups["i64" if name in _INT64 else "i32"]
        return group[offset: offset + numel].view(shape) if isinstance(group, torch.Tensor) \
            else group[offset: offset + numel].reshape(shape)

    def copy_in(self, plan: StepPlan) -> None:
        """Write the plan (live prefix and padded tail) into the buffers."""
        t, r = plan.num_tokens_padded, plan.num_reqs_padded
        if t > self.config.max_num_tokens or r > self.config.max_num_seqs:
            raise ValueError(f"plan of {t} tokens / {r} requests exceeds the static buffers "
                             f"({self.config.max_num_tokens} / {self.config.max_num_seqs})")
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy must have left the staging area
        for name, staging in self._staging:
            src = getattr(plan, name)
            staging[: len(src)] = src
        if self._copied is not None:
            for group in ("i64", "i32"):
                self._dev[group].copy_(self._host[group], non_blocking=True)
            self._copied.record()

    def views(self, num_tokens: int, num_reqs: int) -> BufferViews:
        b = self.tensors
        return BufferViews(
            input_ids=b["input_ids"][:num_tokens], positions=b["positions"][:num_tokens],
            slot_mapping=b["slot_mapping"][:num_tokens], logits_indices=b["logits_indices"][:num_reqs],
            query_start_loc=b["query_start_loc"][: num_reqs + 1], seq_start_loc=b["seq_start_loc"][: num_reqs + 1],
            seq_lens=b["seq_lens"][:num_reqs], block_table=b["block_table"][:num_reqs], logits=self.logits[:num_reqs])

    def poison(self, num_tokens: int, num_reqs: int, garbage: int) -> None:
        """Strict mode: garbage past the bucket (T tokens, R requests) and NaN logits, so a kernel
        reading past its bucket or a real row left unwritten shows. Call after ``copy_in``."""
        for name, buf in self.tensors.items():
            start = num_tokens if name in ("input_ids", "positions", "slot_mapping") else num_reqs
            buf[start + (name in ("query_start_loc", "seq_start_loc")):] = garbage
        self.logits.fill_(float("nan"))

    def addresses(self) -> dict[str, int]:
        """Data pointers of every buffer (for the capture-time address guard)."""
        out = {name: t.data_ptr() for name, t in self.tensors.items()}
        out["logits"] = self.logits.data_ptr()
        return out
