"""HostFetch: a step's outputs copied to the host without waiting for the steps queued behind it.

A loop that launches step N+1 before it reads step N's tokens (``generate.decode_overlapped``, the
engine) must not read them with ``.tolist()``, which waits for everything queued, step N+1 too.
Here each copy goes to one of two pinned sets of buffers, in turn, with an event behind it, so one
set can be read while the next copy is in flight.

On a GPU the copies run on a side stream that waits for the outputs to be written: a
device-to-host copy in the step's own stream is a copy-engine operation between its kernels, and on
an H100 the device idled ~5 us before each one (``benchmarks/profile_loop.py``). The outputs'
memory is marked in use by the side stream until its copy is done.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from . import _compat


class HostFetch:
    """``HostFetch({"name": (shape, dtype), ...}, device)``: pinned host room for outputs of at most
    those shapes (their first dimension the rows)."""

    def __init__(self, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> None:
        cuda = torch.device(device).type == "cuda"
        self._host = [{name: torch.empty(shape, dtype=dtype, pin_memory=cuda) for name, (shape, dtype) in shapes.items()}
                      for _ in range(2)]
        self._step_stream = _compat.CurrentStream(torch.device(device)) if cuda else None
        self._done = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._ready = torch.cuda.Event() if cuda else None
        self._stream = torch.cuda.Stream(device) if cuda else None
        self._rows: list[dict[str, int]] = [{}, {}]   # what each start copied: name -> rows
        self._next = 0

    def start(self, outputs: Mapping[str, torch.Tensor]) -> int:
        """Queue the copy of ``outputs`` (name -> device tensor, any number of rows up to the
        room's); returns the handle for ``wait``. The tensors must be the caller's own (a step's
        copies, a fresh argmax), never views of buffers the next step writes
        (``step(copy_outputs=False)``): the copy runs later, on the side stream."""
        i, self._next = self._next, self._next ^ 1
        host = self._host[i]
        if self._stream is None:
            for name, t in outputs.items():
                host[name][: len(t)].copy_(t)
        else:
            self._ready.record(self._step_stream())     # in the step's stream: the outputs are written
            self._stream.wait_event(self._ready)
            with torch.cuda.stream(self._stream):
                for name, t in outputs.items():
                    host[name][: len(t)].copy_(t, non_blocking=True)
                    t.record_stream(self._stream)   # not reused by the step's stream before the copy
                self._done[i].record()
        self._rows[i] = {name: len(t) for name, t in outputs.items()}
        return i

    def wait(self, handle: int, rows: int | None = None) -> dict[str, np.ndarray]:
        """The outputs one ``start`` copied (by name; their first ``rows`` rows, or as many as it
        copied), once they have arrived: views of the pinned room, valid until the second
        ``start`` after that one (which reuses it); call ``wait`` before that."""
        if self._done[handle] is not None:
            self._done[handle].synchronize()
        host = self._host[handle]
        return {name: host[name][: n if rows is None else rows].numpy() for name, n in self._rows[handle].items()}
