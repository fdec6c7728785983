"""A 100,000-token prompt through ``fg.LLM`` end to end: chunked prefill, then decode.

    python benchmarks/long_context.py [--preset phi3-small-128k] [--prompt-len 100000] [--decode 256]
                                      [--chunk 8192] [--check 32] [--out long_context.json]

GPU script (runs on the CPU only for toy presets): prints a table, writes JSON with ``--out``,
never asserts on time. The model (random weights of the preset's shape, bf16 on CUDA) serves one
request of ``--prompt-len`` random token ids through ``fg.LLM`` in ``"full"`` mode (CUDA graphs;
prefill chunks above the largest captured size run padded-eager, as the engine serves them):
capture time, time to first token (the whole chunked prefill), decode tokens/s, peak device
memory. Then the same request in ``"none"`` mode (eager, unpadded) for ``--check`` greedy tokens,
and whether they equal the first ones of the graph run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

import fullgraph as fg
from fullgraph.models import presets


def serve_one(model, prompt: list[int], new_tokens: int, mode: str, chunk: int) -> dict:
    cuda = torch.cuda.is_available()
    max_len = -(-(len(prompt) + new_tokens + 1) // 256) * 256
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    llm = fg.LLM(model, tokenizer=None, max_num_seqs=1, max_model_len=max_len, max_num_tokens=chunk,
                 cudagraph=mode)
    start = time.perf_counter()
    llm.runner.warmup()  # capture (full) or one run of each shape (none), before the clock starts
    warmup_s = time.perf_counter() - start
    params = fg.SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([prompt], params)[0]
    total = time.perf_counter() - start
    m, ids = out.metrics, out.outputs[0].token_ids
    decode_s = m.finished_time - m.first_token_time
    stats = llm.runner.stats()
    row = {"mode": mode, "prompt_tokens": len(prompt), "new_tokens": len(ids), "chunk": chunk,
           "warmup_s": round(warmup_s, 2), "ttft_s": round(m.time_to_first_token, 3), "total_s": round(total, 3),
           "decode_tok_per_s": round((len(ids) - 1) / decode_s, 1) if len(ids) > 1 else None,
           "decode_ms_per_token": round(1e3 * decode_s / max(1, len(ids) - 1), 3),
           "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
           "kv_GiB": round(sum(c.numel() * c.element_size() for c in llm.runner.kv_caches) / 2**30, 2),
           "graph_hits": sum(stats["graph_hits"].values()), "eager_steps": sum(stats["eager_fallbacks"].values()),
           "tokens": ids}
    del llm
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", default="phi3-small-128k", choices=presets.names())
    parser.add_argument("--prompt-len", type=int, default=100_000)
    parser.add_argument("--decode", type=int, default=256, help="new tokens of the graph run")
    parser.add_argument("--chunk", type=int, default=8192, help="max_num_tokens: the prefill chunk")
    parser.add_argument("--check", type=int, default=32, help="greedy tokens of the eager run to compare")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    model = presets.build(args.preset, dtype=torch.bfloat16 if cuda else torch.float32,
                          device="cuda" if cuda else "cpu")
    vocab = int(model.vocab_size)
    prompt = np.random.default_rng(0).integers(100, min(vocab, 50_000), args.prompt_len).tolist()
    rows = []
    for mode, new in (("full" if cuda else "padded", args.decode), ("none", args.check)):
        print(f"{args.preset}: {args.prompt_len} prompt tokens, {new} new, mode {mode} ...", file=sys.stderr, flush=True)
        rows.append(serve_one(model, prompt, new, mode, args.chunk))
    graph, eager = rows[0]["tokens"][: args.check], rows[1]["tokens"]
    first_diff = next((i for i, (a, b) in enumerate(zip(graph, eager)) if a != b), None)
    cols = ["mode", "prompt_tokens", "new_tokens", "warmup_s", "ttft_s", "decode_tok_per_s", "decode_ms_per_token",
            "peak_GiB", "kv_GiB", "graph_hits", "eager_steps"]
    print("  ".join(f"{c:>18s}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]!s:>18s}" for c in cols))
    same = first_diff is None and len(graph) == len(eager)
    print(f"first {args.check} greedy tokens equal between {rows[0]['mode']} and none: {same}"
          + ("" if same else f" (first difference at token {first_diff})"))
    if args.out:
        meta = {"preset": args.preset, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                "device": torch.cuda.get_device_name() if cuda else "cpu"}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows, "equal_first_tokens": same, "first_difference": first_diff}, f,
                      indent=1)


if __name__ == "__main__":
    main()
