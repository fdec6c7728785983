"""Validate mode (``RunnerConfig(validate=True)``): prove each padded step touched only what it owns.

One mode, three parts: ``padding.check`` verifies the padded plan's invariants before the step;
then this module *poisons* — every static buffer past the step's bucket is filled with garbage,
the outputs, the backends' workspaces and the null block with NaN — and snapshots the KV cache;
after the step: no NaN in a real logits row (-inf is allowed: models mask token ids with it), and
the only KV slots whose bytes changed are the real tokens' slots (the null block included). A
violation raises ``ValidationError`` naming the layer, slot and field. Costs a copy of the whole
KV cache per step: for tests and debugging, not serving. ``check_token_ids`` checks a step's ids
given as a device tensor: their shape and device on every step, their range in this mode only.
"""
from __future__ import annotations

import torch

from .fields import StepPlan

GARBAGE = -(2**30)  # far outside every index range: a kernel reading past its bucket would fault or diverge


class ValidationError(RuntimeError):
    """A step wrote or produced something it must not have."""


class StepValidator:
    def __init__(self, buffers, kv_caches: list[torch.Tensor], block_size: int) -> None:
        self.buffers, self.kv_caches, self.block_size = buffers, kv_caches, block_size
        self._snapshot: list[torch.Tensor] = []

    def before(self, plan: StepPlan) -> None:
        """Poison (called after ``copy_in`` wrote the live prefix and padded tail)."""
        self.buffers.poison(plan.num_tokens_padded, plan.num_reqs_padded, GARBAGE)
        for cache in self.kv_caches:
            cache[:, 0] = float("nan")  # the null block: padded rows may read it, real rows never
        self._snapshot = [c.detach().clone() for c in self.kv_caches]

    def after(self, plan: StepPlan, outputs: dict[str, torch.Tensor]) -> None:
        """Check the step's outputs (real rows only: ``outputs`` holds them, copies or views) and the KV cache."""
        for name, out in outputs.items():
            if out.is_floating_point():  # -inf is legitimate (masked token ids), NaN never
                bad = torch.isnan(out[: plan.num_reqs]).reshape(plan.num_reqs, -1).any(-1)
            else:                        # an integer row left at its poison (-1) was never written
                bad = (out[: plan.num_reqs] < 0).reshape(plan.num_reqs, -1).any(-1)
            if bad.any():
                raise ValidationError(f"{name}: real row {int(bad.nonzero()[0])} is poisoned (NaN or -1): poison from "
                                      "a padded buffer tail, the null block or stale output reached it")
        device = next(iter(outputs.values())).device
        real = torch.from_numpy(plan.slot_mapping[: plan.num_tokens]).to(device)
        for layer, (old, new) in enumerate(zip(self._snapshot, self.kv_caches)):
            slots = old.shape[1] * old.shape[2]
            # bytes, so a NaN written over a NaN still counts as unchanged
            changed = (_bytes(old) != _bytes(new)).view(2, slots, -1).any(-1).any(0)     # (slots,)
            changed[real] = False
            if changed.any():
                slot = int(changed.nonzero()[0])
                raise ValidationError(
                    f"layer {layer}: KV slot {slot} (block {slot // self.block_size}, offset "
                    f"{slot % self.block_size}) changed but belongs to no real token of this step "
                    "(a KV write ignored slot_mapping = -1?)")
        for cache in self.kv_caches:
            cache[:, 0] = 0  # the null block is zero-filled between steps
        self._snapshot = []


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def check_token_ids(token_ids, num_tokens: int, device: torch.device, vocab_size: int, in_range: bool) -> None:
    """``runner.step(token_ids=...)``: a ``(num_tokens,)`` int64 or int32 tensor on ``device``; with
    ``in_range`` (validate mode: waits for the device) every id inside the vocabulary."""
    ok = (isinstance(token_ids, torch.Tensor) and token_ids.device == device
          and token_ids.dtype in (torch.int64, torch.int32) and tuple(token_ids.shape) == (num_tokens,))
    if not ok:
        got = (f"{token_ids.dtype} {tuple(token_ids.shape)} on {token_ids.device}"
               if isinstance(token_ids, torch.Tensor) else type(token_ids).__name__)
        raise ValueError(f"token_ids: expected a ({num_tokens},) int64 or int32 tensor on {device} "
                         f"(the step's {num_tokens} tokens in chunk order), got {got}")
    if in_range:
        bad = (token_ids < 0) | (token_ids >= vocab_size)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"token_ids[{i}] = {int(token_ids[i])}: outside the vocabulary [0, {vocab_size})")
