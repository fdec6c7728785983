"""``python -m fullgraph.bench serve``: a serving workload through ``fg.Engine``, beside the runner's
own decode floor and, where it runs, transformers' continuous batching on the same workload.

Requests have random token prompts of mixed lengths (uniform in [input_len / 2, 3 * input_len / 2]),
each after the same ``shared_prefix`` random tokens (a system prompt; 0: none), and exactly
``output_len`` new tokens (``ignore_eos``), arriving all at once or as a Poisson stream of ``rate``
per second. Reported, with prefix caching on and/or off (one runner, reset in between): output and
total throughput (tokens/s), prompt tokens computed in prefill chunks and the prefix-cache hit
rate, time to first token and time per output token (p50 / p99), and the runner's overlapped
decode floor at the same batch.
"""
from __future__ import annotations

import sys
import time

import numpy as np
import torch

from ..engine import Engine, RequestOutputKind, SamplingParams
from ..models import presets
from ..runner import FullGraphRunner


def workload(args, vocab: int) -> tuple[list[list[int]], np.ndarray]:
    rng = np.random.default_rng(args.seed)
    system = rng.integers(0, vocab, args.shared_prefix).tolist()
    lens = rng.integers(max(1, args.input_len // 2), args.input_len * 3 // 2 + 1, args.requests)
    prompts = [system + rng.integers(0, vocab, n).tolist() for n in lens]
    arrivals = np.zeros(args.requests) if not args.rate else np.cumsum(rng.exponential(1 / args.rate, args.requests))
    return prompts, arrivals


def _progress(done: int, total: int, start: float) -> None:
    if done == total or done % max(1, total // 10) == 0:
        print(f"  {done}/{total} requests done, {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def engine_runner(args, model) -> FullGraphRunner:
    max_len = args.shared_prefix + args.input_len * 3 // 2 + args.output_len + 16
    runner = FullGraphRunner(model, sampling=True, max_num_seqs=args.max_num_seqs, max_num_tokens=args.max_num_tokens,
                             max_model_len=-(-max_len // 256) * 256,
                             cudagraph="full" if torch.cuda.is_available() else "padded")
    runner.warmup()
    return runner


def run_engine(args, runner: FullGraphRunner, prompts, arrivals, caching: bool) -> dict:
    runner.reset()  # every page free: the runs with caching on and off start alike
    engine = Engine(runner, seed=args.seed, enable_prefix_caching=caching)
    # every step's new tokens, as the HTTP server's engine process asks for them (streaming)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    start, queued, done, outputs = time.perf_counter(), 0, 0, {}
    while done < len(prompts):
        now = time.perf_counter() - start
        while queued < len(prompts) and arrivals[queued] <= now:
            engine.add_request(str(queued), prompts[queued], params)
            queued += 1
        if not engine.has_unfinished():
            time.sleep(min(0.001, max(0.0, arrivals[queued] - now)))
            continue
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
                done += 1
                _progress(done, len(prompts), start)
    seconds = time.perf_counter() - start
    ttft = [o.metrics.first_token_time - start - arrivals[int(o.request_id)] for o in outputs.values()]
    tpot = [(o.metrics.finished_time - o.metrics.first_token_time) / max(1, o.metrics.num_generated_tokens - 1)
            for o in outputs.values()]
    stats = engine.stats()
    row = _row(f"fullgraph (prefix caching {'on' if caching else 'off'})", seconds, prompts,
               [o.metrics.num_generated_tokens for o in outputs.values()], ttft, tpot, runner.stats()["eager_fallbacks"])
    row.update(prefill_tokens=stats["prefill_tokens"], hit_rate=stats["prefix_cache_hit_rate"],
               cached_tokens=sum(o.num_cached_tokens for o in outputs.values()))
    return row


def _row(system: str, seconds: float, prompts, generated: list[int], ttft, tpot, note="") -> dict:
    out_tokens = sum(generated)
    return {"system": system, "requests": len(prompts), "seconds": seconds, "output_tok_s": out_tokens / seconds,
            "total_tok_s": (out_tokens + sum(map(len, prompts))) / seconds, "prefill_tokens": float("nan"),
            "hit_rate": float("nan"), "cached_tokens": float("nan"),
            "ttft_p50_ms": float(np.percentile(ttft, 50)) * 1e3, "ttft_p99_ms": float(np.percentile(ttft, 99)) * 1e3,
            "tpot_p50_ms": float(np.percentile(tpot, 50)) * 1e3, "tpot_p99_ms": float(np.percentile(tpot, 99)) * 1e3,
            "note": str(note)[:80]}


def run_hf(args, model, prompts) -> dict:
    """transformers' continuous batching (``generate_batch``) on the same workload, same weights."""
    import transformers

    from ..models import Llama

    if not isinstance(model, Llama):
        raise ValueError("the transformers peer is built for Llama-family presets only")
    c = model.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings)
    param = next(model.parameters())
    hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=param.dtype,
                                                       attn_implementation="sdpa").to(param.device).eval()
    generation = transformers.GenerationConfig(max_new_tokens=args.output_len, do_sample=False, eos_token_id=-1,
                                               pad_token_id=0, max_batch_tokens=args.max_num_tokens)
    start = time.perf_counter()
    result = hf.generate_batch(inputs=prompts, generation_config=generation, progress_bar=False)
    seconds = time.perf_counter() - start
    generated = [len(r.generated_tokens) for r in result.values()]
    return _row("transformers generate_batch", seconds, prompts, generated, [float("nan")], [float("nan")],
                f"transformers {transformers.__version__}")


def bench_serve(args) -> list[dict]:
    from . import _table, time_decode_overlapped

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = presets.build(args.preset, dtype=dtype, device=device, seed=0)
    prompts, arrivals = workload(args, model.vocab_size)
    caching = args.prefix_caching or (["on", "off"] if args.shared_prefix else ["on"])
    print(f"serve: {args.preset}, {args.requests} requests, input {args.input_len // 2}-{args.input_len * 3 // 2} "
          f"tokens after a shared prefix of {args.shared_prefix}, {args.output_len} out, rate "
          f"{args.rate or 'all at once'}, prefix caching {' and '.join(caching)}", flush=True)
    runner = engine_runner(args, model)
    rows = [run_engine(args, runner, prompts, arrivals, c == "on") for c in caching]
    del runner
    batch = min(args.max_num_seqs, args.requests)
    context = args.shared_prefix + args.input_len
    floor_runner = FullGraphRunner(model, max_num_seqs=batch, max_num_tokens=max(batch, 16), capture_sizes=(batch,),
                                   max_model_len=-(-(context + 64 + 8) // 256) * 256,
                                   cudagraph="full" if device.type == "cuda" else "padded")
    floor_runner.warmup()
    step = float(np.median(time_decode_overlapped(floor_runner, batch, context, 20, 5)))
    nan = float("nan")
    rows.append({"system": f"runner decode floor (batch {batch}, overlapped)", "requests": batch, "seconds": step,
                 "output_tok_s": batch / step, "total_tok_s": nan, "prefill_tokens": nan, "hit_rate": nan,
                 "cached_tokens": nan, "ttft_p50_ms": nan, "ttft_p99_ms": nan, "tpot_p50_ms": step * 1e3,
                 "tpot_p99_ms": nan, "note": ""})
    if args.peer_hf:
        try:
            rows.append(run_hf(args, model, prompts))
        except Exception as err:  # noqa: BLE001 (a peer that cannot run is reported, not fatal)
            rows.append({**{k: float("nan") for k in rows[0]}, "system": "transformers generate_batch",
                         "note": f"did not run: {type(err).__name__}: {err}"[:80]})
    _table(rows, ["system", "requests", "seconds", "output_tok_s", "total_tok_s", "prefill_tokens", "hit_rate",
                  "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "note"])
    return rows
