"""StaticBuffers: the persistent, max-size device buffers a captured graph reads.

Allocated once; their addresses never change (a graph replays raw pointers). Every step input lives
in one byte buffer, mirrored by one pinned host staging area, so a step costs one host-to-device
copy: the planner writes the padded plan straight into the staging area (``staging``), and
``upload`` sends it. On a CPU device the staging area *is* the buffer.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .config import RunnerConfig
from .plan import StepPlan, array_shapes

_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


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


def _layout(config: RunnerConfig) -> tuple[dict[str, tuple[slice, tuple[int, ...], np.dtype]], int]:
    """field -> (bytes, shape, dtype) in the one buffer, and its size in bytes. The int64 fields
    come first, so every field is aligned to its element size."""
    shapes = array_shapes(config.max_num_tokens, config.max_num_seqs, config.max_blocks_per_seq)
    out, offset = {}, 0
    for name, (shape, dtype) in sorted(shapes.items(), key=lambda item: -np.dtype(item[1][1]).itemsize):
        dtype = np.dtype(dtype)
        end = offset + int(np.prod(shape)) * dtype.itemsize
        out[name], offset = (slice(offset, end), shape, dtype), end
    return out, offset


class StaticBuffers:
    """Max-size step inputs and the logits output, at fixed addresses on ``device``."""

    def __init__(self, config: RunnerConfig, vocab_size: int, device: torch.device) -> None:
        self.config, self.device = config, torch.device(device)
        layout, nbytes = _layout(config)
        on_cuda = self.device.type == "cuda"
        self._dev = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self._host = torch.zeros(nbytes, dtype=torch.uint8).pin_memory() if on_cuda else self._dev
        host = self._host.numpy()
        self.tensors = {name: self._dev[b].view(_TORCH[dt]).view(shape) for name, (b, shape, dt) in layout.items()}
        self._staging = {name: host[b].view(dt).reshape(shape) for name, (b, shape, dt) in layout.items()}
        self.logits = torch.zeros(config.max_num_seqs, vocab_size, dtype=torch.float32, device=self.device)
        self._logits_rows = [self.logits[:n] for n in range(config.max_num_seqs + 1)]  # slicing costs ~1 us a step
        self._copied = torch.cuda.Event() if on_cuda else None
        if on_cuda:
            self._device_index = torch.cuda.current_device() if self.device.index is None else self.device.index
            self._stream_key, self._stream = None, None

    def staging(self) -> dict[str, np.ndarray]:
        """The max-size host arrays ``upload`` sends (``plan_step``'s ``out``), once the previous
        upload has left them. What is written there lasts until the next ``staging`` or ``copy_in``."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._staging

    def upload(self, input_ids: torch.Tensor | None = None) -> None:
        """Send the staging area to the device buffers (asynchronous; a no-op on CPU), then, when
        given, ``input_ids`` (a device tensor) over the first ``len(input_ids)`` staged ids."""
        if self._copied is not None:
            self._dev.copy_(self._host, non_blocking=True)
            self._copied.record(self._current_stream())
        if input_ids is not None:  # stream-ordered after the upload
            self.tensors["input_ids"][: len(input_ids)].copy_(input_ids)

    def _current_stream(self) -> torch.cuda.Stream:
        """The stream the copy went to, rebuilt only when it changes: ``torch.cuda.current_stream()``
        spends ~4 us of host time building a Stream object on every call."""
        key = torch._C._cuda_getCurrentStream(self._device_index)
        if key != self._stream_key:
            self._stream_key, self._stream = key, torch.cuda.current_stream(self._device_index)
        return self._stream

    def copy_in(self, plan: StepPlan) -> None:
        """Write a plan made elsewhere (live prefix and padded tail) into the buffers."""
        t, r = plan.num_tokens_padded, plan.num_reqs_padded
        if t > self.config.max_num_tokens or r > self.config.max_num_seqs:
            raise ValueError(f"plan of {t} tokens / {r} requests exceeds the static buffers "
                             f"({self.config.max_num_tokens} / {self.config.max_num_seqs})")
        for name, staging in self.staging().items():
            src = getattr(plan, name)
            staging[: len(src)] = src
        self.upload()

    def logits_copy(self, num_reqs: int) -> torch.Tensor:
        """The first ``num_reqs`` rows of the logits, as a tensor of the caller's own."""
        return self._logits_rows[num_reqs].clone()

    def views(self, num_tokens: int, num_reqs: int) -> BufferViews:
        b = self.tensors
        return BufferViews(
            input_ids=b["input_ids"][:num_tokens], positions=b["positions"][:num_tokens],
            slot_mapping=b["slot_mapping"][:num_tokens], logits_indices=b["logits_indices"][:num_reqs],
            query_start_loc=b["query_start_loc"][: num_reqs + 1], seq_start_loc=b["seq_start_loc"][: num_reqs + 1],
            seq_lens=b["seq_lens"][:num_reqs], block_table=b["block_table"][:num_reqs], logits=self.logits[:num_reqs])

    def poison(self, num_tokens: int, num_reqs: int, garbage: int) -> None:
        """Strict mode: garbage past the bucket (T tokens, R requests) and NaN logits, so a kernel
        reading past its bucket or a real row left unwritten shows. Call after ``upload``."""
        for name, buf in self.tensors.items():
            start = num_tokens if name in ("input_ids", "positions", "slot_mapping") else num_reqs
            buf[start + (name in ("query_start_loc", "seq_start_loc")):] = garbage
        self.logits.fill_(float("nan"))

    def addresses(self) -> dict[str, int]:
        """Data pointers of every buffer (for the capture-time address guard)."""
        out = {name: t.data_ptr() for name, t in self.tensors.items()}
        out["logits"] = self.logits.data_ptr()
        return out
