"""The sharded layers: a row-parallel linear, the vocabulary-parallel embedding and LM head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..models.layers import Linear, kernels
from .group import TensorParallel


class RowParallelLinear(Linear):
    """A linear whose input features are split across ranks: each rank multiplies its slice of
    the input by its columns of the weight, one all-reduce sums them, then the (whole) bias is
    added once, then the residual, if given. Its kernel path is ``Linear``'s."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallel) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.tp = tp

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None, residual: torch.Tensor | None = None,
                activation: str = "none", limit: float | None = None) -> torch.Tensor:
        if norm is not None or activation != "none":
            raise ValueError("RowParallelLinear: its input is split across ranks, so it cannot normalise it or "
                             "gate its output (the sum exists only after the all-reduce)")
        y = kernels.linear(x, self.weight, None) if self.uses_kernel(x) else F.linear(x, self.weight)
        y = self.tp.all_reduce(y)
        y = y if self.bias is None else y + self.bias
        return y if residual is None else y + residual


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + num_rows)`` of the embedding table; ids outside them embed to zero,
    and one all-reduce assembles every token's row."""

    def __init__(self, weight: torch.Tensor, start: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.tp = start, tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.tp.all_reduce(torch.where(inside[:, None], rows, torch.zeros((), dtype=rows.dtype,
                                                                                  device=rows.device)))

    def extra_repr(self) -> str:
        return f"rows [{self.start}, {self.start + self.weight.shape[0]}) of the vocabulary"


class VocabParallelHead(nn.Module):
    """The LM head over this rank's vocabulary rows (the embedding's own when tied); one
    all-gather gives every rank the full ``(N, vocab)`` logits in the model's dtype."""

    def __init__(self, weight: nn.Parameter, tp: TensorParallel) -> None:
        super().__init__()
        self.weight, self.tp = weight, tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(hidden @ self.weight.t())
