"""Tensor parallelism against one process: ``torchrun --nproc-per-node N -m fullgraph.testing.parallel``.

Every rank builds the same model twice: whole (the reference, run by this process alone) and
sharded over the group (``fullgraph.parallel.shard_model``; with ``--checkpoint DIR``, loaded
from a safetensors checkpoint reading only the rank's shard). A random multi-step workload (several
requests, chunked prefills and decodes mixed, random subsets each step) runs on both runners,
page for page, and every step's logits are compared; then ``fg.LLM`` greedy-generates from both.
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


def workload(runner_pair, steps: int, seed: int) -> float:
    """Random steps on (reference, sharded) runners; returns the worst relative logit error."""
    rng = random.Random(seed)
    ref, tp = runner_pair
    vocab, bs = ref.vocab_size, ref.config.block_size
    live: dict[int, dict] = {}
    worst = 0.0
    for step in range(steps):
        while len(live) < 5:  # new requests: a prompt, its pages (the same ids on both runners)
            length = rng.randint(1, 120)
            pages = ref.blocks.allocate(-(-(length + 40) // bs))
            assert tp.blocks.allocate(len(pages)) == pages
            live[len(live) + 100 * step] = {"prompt": [rng.randrange(vocab) for _ in range(length)], "pos": 0,
                                           "pages": pages, "left": rng.randint(1, 30)}
        chunks, budget = [], ref.config.max_num_tokens
        for rid in rng.sample(sorted(live), rng.randint(1, len(live))):
            req = live[rid]
            todo = len(req["prompt"]) - req["pos"]
            n = min(todo, rng.randint(1, 48), budget) if todo > 0 else 1
            if n < 1:
                continue
            ids = req["prompt"][req["pos"]: req["pos"] + n] if todo > 0 else [rng.randrange(vocab)]
            chunks.append(SeqChunk(ids, req["pos"], req["pages"], request_id=rid))
            budget -= n
        a, b = ref.step(chunks).logits, tp.step(chunks).logits
        finite = torch.isfinite(a)
        if not torch.equal(finite, torch.isfinite(b)) or not torch.equal(a[~finite], b[~finite]):
            return float("inf")  # a masked (-inf) logit in one and not the other, or a NaN
        worst = max(worst, float((a - b)[finite].abs().max() / a[finite].abs().max()))
        for c in chunks:
            req = live[c.request_id]
            req["pos"] += len(c.token_ids)
            if req["pos"] >= len(req["prompt"]):
                req["left"] -= 1
                if req["left"] == 0 or req["pos"] >= len(req["pages"]) * bs - 1:
                    ref.blocks.free(req["pages"])
                    tp.blocks.free(req["pages"])
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
        whole = from_pretrained(args.checkpoint, device=device)
        sharded = from_pretrained(args.checkpoint, device=device, tensor_parallel=tp)
    else:
        whole, sharded = MODELS[args.model]().to(device), shard_model(MODELS[args.model]().to(device), tp)
    runners = [FullGraphRunner(m, cudagraph=args.mode, attention="sdpa", compile=c, **LIMITS)
               for m, c in ((whole, False), (sharded, args.compile))]
    worst = workload(runners, args.steps, args.seed)
    stats = runners[1].stats()
    prompts = [[random.Random(args.seed + i).randrange(whole.vocab_size) for _ in range(5 + 7 * i)] for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = [[list(o.outputs[0].token_ids) for o in LLM(m, cudagraph=args.mode, **LIMITS).generate(prompts, greedy)]
              for m in (whole, sharded)]
    result = {"model": args.checkpoint or args.model, "world_size": tp.world_size, "mode": args.mode, "compile": args.compile,
              "compiled_graphs": stats["compiled_graphs"], "recompiles": stats["recompiles_after_warmup"],
              "steps": args.steps,
              "max_rel_logit_error": worst, "greedy_equal": tokens[0] == tokens[1], "greedy_tokens": tokens[1]}
    if tp.rank == 0:
        line = json.dumps(result)
        print(line, flush=True)
        if args.out:
            with open(args.out, "w") as f:
                f.write(line + "\n")
    del runners, whole, sharded  # nothing that holds the group outlives it
    close_tensor_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
