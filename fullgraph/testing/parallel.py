"""Tensor parallelism against one process: ``torchrun --nproc-per-node N -m fullgraph.testing.parallel``.

Every rank builds the model sharded over the group (``fullgraph.parallel.shard_model``; with
``--checkpoint DIR``, loaded from a safetensors checkpoint reading only the rank's shard); rank 0
also builds it whole, the reference it runs alone (every rank's gathered logits are the same, so
one reference is enough, and on a CPU the ranks share the cores). A random multi-step workload
(several requests, chunked prefills and decodes mixed, random subsets each step) runs on both
runners, page for page, and every step's logits are compared; then ``fg.LLM`` greedy-generates
from both.
Rank 0 prints one JSON line: the largest logit error relative to the largest logit, and whether
the greedy tokens agree (and, with ``--compile``, the sharded runner's compiled graphs and
recompiles after warm-up); ``--out`` also writes it to a file.
"""
from __future__ import annotations

import argparse
import json
import random
import sys

import torch

from ..engine import LLM, SamplingParams
from ..models import Llama, LlamaConfig, Phi3Small, Phi3SmallConfig, from_pretrained
from ..parallel import close_tensor_parallel, init_tensor_parallel, shard_model
from ..plan import SeqChunk
from ..runner import FullGraphRunner

MODELS = {"toy-llama": lambda: Llama(LlamaConfig.toy(), seed=0),
          "toy-llama-mqa": lambda: Llama(LlamaConfig.toy().replace(num_kv_heads=1), seed=0),
          "toy-phi3-small": lambda: Phi3Small(Phi3SmallConfig.toy(), seed=0)}
LIMITS = dict(max_num_seqs=8, max_num_tokens=128, max_model_len=256, block_size=16)


def workload(ref: FullGraphRunner | None, tp: FullGraphRunner, steps: int, seed: int) -> float:
    """Random steps on the sharded runner ``tp`` and, where given (rank 0), the reference ``ref``;
    returns the worst relative logit error (0 without a reference). Every rank draws the same steps."""
    rng = random.Random(seed)
    vocab, bs = tp.vocab_size, tp.config.block_size
    live: dict[int, dict] = {}
    worst = 0.0
    for step in range(steps):
        while len(live) < 5:  # new requests: a prompt, its pages (the same ids on both runners)
            length = rng.randint(1, 120)
            pages = tp.blocks.allocate(-(-(length + 40) // bs))
            assert ref is None or ref.blocks.allocate(len(pages)) == pages
            live[len(live) + 100 * step] = {"prompt": [rng.randrange(vocab) for _ in range(length)], "pos": 0,
                                           "pages": pages, "left": rng.randint(1, 30)}
        chunks, budget = [], tp.config.max_num_tokens
        for rid in rng.sample(sorted(live), rng.randint(1, len(live))):
            req = live[rid]
            todo = len(req["prompt"]) - req["pos"]
            n = min(todo, rng.randint(1, 48), budget) if todo > 0 else 1
            if n < 1:
                continue
            ids = req["prompt"][req["pos"]: req["pos"] + n] if todo > 0 else [rng.randrange(vocab)]
            chunks.append(SeqChunk(ids, req["pos"], req["pages"], request_id=rid))
            budget -= n
        b = tp.step(chunks).logits   # every rank steps (the collectives), whatever rank 0 finds below
        if ref is not None:
            a = ref.step(chunks).logits
            finite = torch.isfinite(a)
            if not torch.equal(finite, torch.isfinite(b)) or not torch.equal(a[~finite], b[~finite]):
                worst = float("inf")  # a masked (-inf) logit in one and not the other, or a NaN
            else:
                worst = max(worst, float((a - b)[finite].abs().max() / a[finite].abs().max()))
        for c in chunks:
            req = live[c.request_id]
            req["pos"] += len(c.token_ids)
            if req["pos"] >= len(req["prompt"]):
                req["left"] -= 1
                if req["left"] == 0 or req["pos"] >= len(req["pages"]) * bs - 1:
                    tp.blocks.free(req["pages"])
                    if ref is not None:
                        ref.blocks.free(req["pages"])
                    del live[c.request_id]
    return worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fullgraph.testing.parallel", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="toy-llama")
    p.add_argument("--checkpoint", help="a safetensors checkpoint directory instead of --model: each rank reads "
                                        "only its shard of it (from_pretrained(..., tensor_parallel=...))")
    p.add_argument("--mode", default="padded", help='runner mode of both runners (default: "padded")')
    p.add_argument("--compile", action="store_true", help="compile=True for the sharded runner")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the JSON line here (rank 0)")
    args = p.parse_args(argv)
    tp = init_tensor_parallel()
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if torch.cuda.is_available() else torch.device("cpu")
    if args.checkpoint:
        sharded = from_pretrained(args.checkpoint, device=device, tensor_parallel=tp)
        whole = from_pretrained(args.checkpoint, device=device) if tp.rank == 0 else None
    else:
        sharded = shard_model(MODELS[args.model]().to(device), tp)
        whole = MODELS[args.model]().to(device) if tp.rank == 0 else None
    runner = FullGraphRunner(sharded, cudagraph=args.mode, attention="sdpa", compile=args.compile, **LIMITS)
    ref = None if whole is None else FullGraphRunner(whole, cudagraph=args.mode, attention="sdpa", **LIMITS)
    worst = workload(ref, runner, args.steps, args.seed)
    stats = runner.stats()
    prompts = [[random.Random(args.seed + i).randrange(sharded.vocab_size) for _ in range(5 + 7 * i)] for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = [[list(o.outputs[0].token_ids) for o in LLM(m, cudagraph=args.mode, **LIMITS).generate(prompts, greedy)]
              for m in (sharded, whole) if m is not None]
    if tp.rank == 0:
        result = {"model": args.checkpoint or args.model, "world_size": tp.world_size, "mode": args.mode,
                  "compile": args.compile, "compiled_graphs": stats["compiled_graphs"],
                  "recompiles": stats["recompiles_after_warmup"], "steps": args.steps, "max_rel_logit_error": worst,
                  "greedy_equal": tokens[0] == tokens[1], "greedy_tokens": tokens[0]}
        line = json.dumps(result)
        print(line, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(line + "\n")
    del runner, ref, whole, sharded  # nothing that holds the group outlives it
    close_tensor_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
