"""Tensor parallelism over ``torch.distributed``, the Megatron way: one process per device, each
holding a shard of every layer and its own paged KV cache, all running the same steps.

- ``TensorParallel``: the group (``init_tensor_parallel()`` reads ``torchrun``'s environment and
  starts NCCL on GPUs, gloo on CPUs) and the collectives the layers call: functional collectives,
  so they are traced by ``torch.compile(fullgraph=True)`` and recorded into CUDA graphs.
- ``shard_model(model, tp)``: a built model's layers sliced in place (``shard.py``): column-parallel
  QKV and gate/up, row-parallel ``o_proj`` / ``down_proj`` with one all-reduce each, the
  vocabulary split over the embedding (one all-reduce) and the LM head (one all-gather, so every
  rank holds the same full logits and samples the same token from the same seeds). KV heads are
  split across ranks, or replicated when there are fewer KV heads than ranks; Phi-3-Small's
  block-sparse layers keep the global head index of their first head. ``shard.shard_plan`` is the
  one source of what a rank keeps; ``shard.checkpoint_cuts`` turns it into the slices a rank reads
  of a safetensors checkpoint (``from_pretrained(path, tensor_parallel=tp)``).

A sharded model follows the model protocol, so ``FullGraphRunner``, ``fg.LLM`` and the engine
run it unchanged, every rank with the same inputs (the engine is deterministic: every rank
schedules the same steps). See README "More than one GPU".
"""
from .group import TensorParallel, close_tensor_parallel, init_tensor_parallel, tensor_parallel_of_size
from .shard import shard_model

__all__ = ["TensorParallel", "close_tensor_parallel", "init_tensor_parallel", "shard_model", "tensor_parallel_of_size"]
