"""StaticBuffers: the persistent, max-size device buffers a captured graph reads and writes.

Allocated once; their addresses never change (a graph replays raw pointers). Every step field of
the runner's table (``fullgraph.fields``) lives in one byte buffer, mirrored by one pinned host
staging area, so a step costs one host-to-device copy: the planner writes the padded plan
straight into the staging area (``staging``), ``upload`` writes what the host sends beside it
(ids handed over on the device, "host" fields), and ``stage`` (the first thing a padded step runs,
captured into its graph) copies the area in: one kernel (``kernels.stage_in``) that reads the
pinned area over the bus, so the host launches nothing but the graph. The host rewrites the area
only once the previous step's copy has run (``staging`` waits on an event the graph records right
after it). On a CPU device the staging area *is* the buffer. The step's outputs (logits, sampled
ids, ...) are buffers of their own.
Backends' workspaces are registered here too, so poisoning and the address guard cover them.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from . import env
from ._compat import CurrentStream
from .config import RunnerConfig
from .fields import FieldTable, StepPlan
from .kernels.stage_in import CONTROL, stage_in
from .layout import Staging

_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
          np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}


def _layout(fields: FieldTable, config: RunnerConfig) -> tuple[dict[str, tuple[slice, tuple[int, ...], np.dtype]], int]:
    """field -> (bytes, shape, dtype) in the one buffer, and its size in bytes. Wider elements come
    first, so every field is aligned to its element size."""
    shapes = fields.shapes(config.max_num_tokens, config.max_num_seqs, config.max_blocks_per_seq)
    shapes = {n: v for n, v in shapes.items() if fields[n].source != "host"}
    out, offset = {}, 0
    for name, (shape, dtype) in sorted(shapes.items(), key=lambda item: -item[1][1].itemsize):
        end = offset + int(np.prod(shape)) * dtype.itemsize
        out[name], offset = (slice(offset, end), shape, dtype), end
    return out, offset + 4 * CONTROL   # the stage-in's control words at the end


class StaticBuffers:
    """Max-size step fields and outputs, at fixed addresses on ``device``.

    Args:
        config: the limits every buffer is sized from.
        fields: the step fields (one buffer each, in the shared byte buffer).
        outputs: name -> (per-request shape, torch dtype) of each step output, e.g.
            ``{"logits": ((vocab,), torch.float32)}``; buffers of ``(max_num_seqs, *shape)``.
        device: where the buffers live.
    """

    def __init__(self, config: RunnerConfig, fields: FieldTable, outputs: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 device: torch.device) -> None:
        self.config, self.fields, self.device = config, fields, torch.device(device)
        layout, nbytes = _layout(fields, config)
        on_cuda = self.device.type == "cuda"
        self._dev = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self._host = torch.zeros(nbytes, dtype=torch.uint8).pin_memory() if on_cuda else self._dev
        # what the stage-in kernel copies: every field is 4 or 8 bytes wide, so the area is whole words;
        # the last two (host side) name the words it skips this step, those of ids written on the device
        self._words = (self._host.view(torch.int32), self._dev.view(torch.int32))
        self._skip = self._host.numpy().view(np.int32)[-CONTROL:]
        self._skip[:] = 0
        ids_bytes, _, ids_dtype = layout["input_ids"]
        self._ids_word, self._ids_words = ids_bytes.start // 4, ids_dtype.itemsize // 4   # first word, words an id
        host = self._host.numpy()
        self.tensors = {name: self._dev[b].view(_TORCH[dt]).view(shape) for name, (b, shape, dt) in layout.items()}
        self._staging = Staging({name: host[b].view(dt).reshape(shape) for name, (b, shape, dt) in layout.items()})
        # "host" fields (big, written by their owner only when it has values) live apart, and are
        # uploaded only in the steps that wrote them (``upload(side=...)``), never every step
        self._side_host: dict[str, torch.Tensor] = {}
        for name, f in fields.items():
            if f.source == "host":
                shape = f.shape(config.max_num_tokens, config.max_num_seqs, config.max_blocks_per_seq)
                dev = torch.zeros(shape, dtype=_TORCH[f.dtype], device=self.device)
                host_t = torch.zeros(shape, dtype=dev.dtype).pin_memory() if on_cuda else dev
                self.tensors[name], self._side_host[name], self._staging[name] = dev, host_t, host_t.numpy()
        self.outputs = {name: torch.zeros(config.max_num_seqs, *shape, dtype=dtype, device=self.device)
                        for name, (shape, dtype) in outputs.items()}
        # slicing costs ~1 us a step: every output's first n rows, made once
        self._rows = {name: [t[:n] for n in range(config.max_num_seqs + 1)] for name, t in self.outputs.items()}
        self.workspaces: dict[str, torch.Tensor] = {}
        # state carried from one step to the next (never poisoned): the last step's sampled ids,
        # which the next step's graph reads for tokens whose prev_token_row says so
        self.feedback = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)
        # recorded right after the stage-in, inside each graph (external: an event-record node of its
        # own, which every replay records), so the host knows when it may rewrite the staging area;
        # on a branch of its own (a second stream, rejoined at the step's end), so that the record
        # runs beside the model's kernels, not between them (FULLGRAPH_STAGE_EVENT=inline: between)
        self._copied = torch.cuda.Event(external=True) if on_cuda else None
        self._branch = torch.cuda.Stream(self.device) if on_cuda and env.stage_event() == "branch" else None
        self._current_stream = CurrentStream(self.device) if on_cuda else None   # the stream the step runs on


    def add_workspaces(self, owner: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Register device tensors a backend's kernels write before they read them (split-KV
        partials, ...), as ``owner.name``: validate mode poisons them, the address guard checks them."""
        for name, t in tensors.items():
            self.workspaces[f"{owner}.{name}"] = t

    def staging(self) -> dict[str, np.ndarray]:
        """The max-size host arrays the step's stage-in sends (``plan_step``'s ``out``), once the
        previous step's stage-in has read them. What is written there lasts until the next
        ``staging`` or ``copy_in``."""
        if self._copied is not None:
            self._copied.synchronize()
        return self._staging

    def upload(self, input_ids: torch.Tensor | None = None, vocab_size: int | None = None,
               side: Mapping[str, int] | None = None) -> None:
        """What a step sends besides the staging area, before its graph (asynchronous): given
        ``input_ids`` (a device tensor), those ids over the first ``len(input_ids)`` of the step's
        ids, clamped into ``[0, vocab_size)`` so that no id reads outside the embedding (the
        stage-in then skips their words); ``side``: "host" fields this step wrote, name -> rows to
        send (copies in the step's stream: only steps that wrote them, e.g. grammar masks, pay for
        them). The staging area itself goes in with ``stage``."""
        if input_ids is not None:
            dst = self.tensors["input_ids"][: len(input_ids)]
            if vocab_size is None:
                dst.copy_(input_ids)
            else:
                torch.clamp(input_ids.to(dst.dtype), 0, vocab_size - 1, out=dst)
        if self._copied is None:
            return
        n = 0 if input_ids is None else len(input_ids) * self._ids_words
        self._skip[0], self._skip[1] = self._ids_word, self._ids_word + n
        for name, rows in (side or {}).items():
            self.tensors[name][:rows].copy_(self._side_host[name][:rows], non_blocking=True)

    def stage(self) -> None:
        """The staging area into the device buffers (but the words of ids ``upload`` wrote there),
        then the event ``staging`` waits on (in the step's stream, or on a branch beside it: see
        ``join``): the first work of every padded step, captured into its graph. A no-op on a CPU
        device (the staging area is the buffers)."""
        if self._copied is not None:
            stream = self._current_stream()
            stage_in(*self._words)
            if self._branch is None:
                self._copied.record(stream)
            else:
                self._branch.wait_stream(stream)
                self._copied.record(self._branch)

    def join(self) -> None:
        """The last work of every padded step: with the event on a branch, the step's stream waits
        for it (a captured graph's branches must rejoin before the capture ends)."""
        if self._branch is not None:
            self._current_stream().wait_stream(self._branch)

    def copy_in(self, plan: StepPlan) -> None:
        """Write a plan made elsewhere (live prefix and padded tail) into the staging area and send
        its "host" fields; the step's ``stage`` copies the rest in."""
        t, r = plan.num_tokens_padded, plan.num_reqs_padded
        if t > self.config.max_num_tokens or r > self.config.max_num_seqs:
            raise ValueError(f"plan of {t} tokens / {r} requests exceeds the static buffers "
                             f"({self.config.max_num_tokens} / {self.config.max_num_seqs})")
        missing = set(self.fields) - set(plan.arrays)
        if missing:
            raise ValueError(f"plan lacks the step fields {sorted(missing)} these buffers hold")
        for name, staging in self.staging().items():
            src = plan.arrays[name]
            staging[: len(src)] = src
        self.upload(side={n: len(plan.arrays[n]) for n in self._side_host})

    def output_copy(self, name: str, num_reqs: int) -> torch.Tensor:
        """The first ``num_reqs`` rows of an output, as a tensor of the caller's own."""
        return self._rows[name][num_reqs].clone()

    def views(self, num_tokens: int, num_reqs: int) -> dict[str, torch.Tensor]:
        """Every step field sized to one bucket (T tokens, R requests): the model step's inputs."""
        return {name: self.tensors[name][: f.real_rows(num_tokens, num_reqs)] for name, f in self.fields.items()}

    def output_views(self, num_reqs: int) -> dict[str, torch.Tensor]:
        return {name: rows[num_reqs] for name, rows in self._rows.items()}

    def poison(self, num_tokens: int, num_reqs: int, garbage: int) -> None:
        """Validate mode: garbage past the bucket (T tokens, R requests) in every field, NaN in the
        float outputs and workspaces (-1 in int outputs), so a kernel reading past its bucket or a
        real row left unwritten shows. Call after ``upload``: the staged fields' tails are poisoned
        in the staging area (the step's stage-in copies them in; on a CPU it is the buffers), the
        "host" fields' on the device."""
        for name, f in self.fields.items():
            rows = f.real_rows(num_tokens, num_reqs)
            buf = self._staging[name] if name not in self._side_host else self.tensors[name]
            buf[rows:] = garbage if f.dtype.kind in "iu" else float("nan")
        for t in (*self.outputs.values(), *self.workspaces.values()):
            t.fill_(float("nan") if t.is_floating_point() else -1)

    def addresses(self) -> dict[str, int]:
        """Data pointers of every buffer (for the capture-time address guard)."""
        out = {name: t.data_ptr() for name, t in self.tensors.items()}
        out.update({name: t.data_ptr() for name, t in self.outputs.items()})
        out.update({name: t.data_ptr() for name, t in self.workspaces.items()})
        out["feedback"] = self.feedback.data_ptr()
        return out
