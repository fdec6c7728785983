"""The tensor-parallel group and its collectives."""
from __future__ import annotations

import atexit
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

# all_gather_tensor is deprecated in newer PyTorch for all_gather_single (same signature)
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


@dataclass(frozen=True)
class TensorParallel:
    """``world_size`` ranks of ``group``; this process is ``rank``. The collectives are functional
    (they return new tensors): capture-safe and traceable by ``torch.compile``."""

    rank: int
    world_size: int
    group: dist.ProcessGroup

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside [0, {self.world_size})")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``."""
        return funcol.wait_tensor(funcol.all_reduce(x, "sum", self.group))

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C) on each rank -> (N, world_size * C), rank r's columns at [r * C, (r + 1) * C)."""
        n, c = x.shape
        stacked = funcol.wait_tensor(_all_gather(x.contiguous(), 0, self.group))        # (world * N, C)
        return stacked.view(self.world_size, n, c).permute(1, 0, 2).reshape(n, self.world_size * c)


def init_tensor_parallel(backend: str | None = None) -> TensorParallel:
    """The group of every process ``torchrun`` started (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
    the rendezvous variables in the environment), creating the default process group if needed:
    NCCL when CUDA is available (each process on ``cuda:LOCAL_RANK``), else gloo."""
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(f"tensor parallelism needs the torchrun environment (missing {missing}): launch with "
                             "torchrun --nproc-per-node N ..., or call torch.distributed.init_process_group first")
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        atexit.register(close_tensor_parallel)
    return TensorParallel(dist.get_rank(), dist.get_world_size(), dist.group.WORLD)


def tensor_parallel_of_size(size: int) -> TensorParallel:
    """``init_tensor_parallel()``, refusing a group of another size than the ``tensor_parallel_size`` asked for."""
    tp = init_tensor_parallel()
    if tp.world_size != size:
        raise ValueError(f"tensor_parallel_size={size}, but torchrun started {tp.world_size} processes "
                         f"(--nproc-per-node {size})")
    return tp


def close_tensor_parallel() -> None:
    """Leave the default group together and destroy it while the interpreter is whole (registered at
    exit by ``init_tensor_parallel`` for the group it created; a no-op once destroyed). Gloo's worker
    threads still hold finished collectives' tensors; freed during interpreter finalisation, or torn
    down while a peer still talks to this rank, they abort the process."""
    if not dist.is_initialized():
        return
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
