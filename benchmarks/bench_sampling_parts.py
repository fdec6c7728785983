"""What does each ingredient of a sampling pass cost on this GPU?

    python benchmarks/bench_sampling_parts.py [--out parts.json] [--rows 32 64]

GPU script: prints a table, writes JSON only with ``--out``, never asserts on time. Each variant is a
row pass shaped like the sampling kernel's (``kernels/sampling.py``: (rows, chunks) programs,
1024-token steps, about 8 programs per SM) over fresh float32 logits of V = 128256 per call, timed
as a CUDA graph of back-to-back calls. The variants add one ingredient at a time to a pass that
only reads the row (its max): the exponential, a count histogram of 16 / 64 / 256 buckets
(``tl.histogram``), eight exact masked sums, Philox4x32-10 + Gumbel noise for every token (the
compacting pass's dominant work) and the noise without its logarithms, a stream compaction
(``tl.cumsum``), and a scan that keeps the raw max, the noisy winner and the runner-up score
per position. The difference to "read" is what that ingredient adds to a pass.
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from bench_sampling import time_calls  # benchmarks/ is the script's directory
from fullgraph.kernels.sampling_common import _noise_block, _philox_words

VOCAB = 128_256
BLOCK = 1024
COPIES = 8


@triton.jit
def _pass(x_ptr, out_ptr, hist_ptr, cand_ptr, vocab, chunk, num_chunks, stride,
          KIND: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr):
    row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    acc = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    hist = tl.zeros([NB], tl.int32)
    n = 0
    win = tl.full([BLOCK], float("-inf"), tl.float32)
    arg = tl.zeros([BLOCK], tl.int32)
    seed, offset = row * 0 + row, row * 0 + 7   # int64 tensors, as the kernel's loads give
    for off in range(0, chunk, BLOCK):
        start = c * chunk + off
        idx = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride + idx, mask=idx < vocab, other=float("-inf"))
        if KIND == 0:        # read: the max
            best = tl.maximum(best, x)
        elif KIND == 1:      # + the exponential
            best = tl.maximum(best, x)
            acc += tl.exp(x - 8.0)
        elif KIND == 2:      # + a count histogram of d = 8 - x in 1/16 nat buckets
            acc += tl.exp(x - 8.0)
            d = 8.0 - x
            pos = tl.where(d < (NB - 1) / 16.0, d * 16.0, NB - 1).to(tl.int32)
            hist += tl.histogram(pos, NB)
        elif KIND == 3:      # eight exact masked sums (count and mass above 8 thresholds)
            e = tl.exp(x - 8.0)
            for j in tl.static_range(8):
                above = x >= 8.0 - j * 0.5
                acc += tl.where(above, e, 0.0)
                best += above.to(tl.float32)
        elif KIND == 4:      # Philox + Gumbel noise for every token, the per-lane winner of x + g
            best = tl.maximum(best, x + _noise_block(start, seed, offset, BLOCK))
        elif KIND == 5:      # the Philox words alone
            r0, r1, r2, r3 = _philox_words(start // 4 + tl.arange(0, BLOCK // 4), seed, offset)
            bits = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK])
            best = tl.maximum(best, x + (bits >> 9).to(tl.float32))
        elif KIND == 7:      # the raw max and argmax, the noisy winner and runner-up score per position
            best = tl.maximum(best, x)
            sc = x + _noise_block(start, seed, offset, BLOCK)
            acc = tl.maximum(acc, tl.minimum(sc, win))
            arg = tl.where(sc > win, idx, arg)
            win = tl.maximum(win, sc)
        else:                # a stream compaction of the tokens above a threshold
            mid = x > 2.0
            k = tl.sum(mid.to(tl.int32), 0)
            if k > 0:
                dst = n + tl.cumsum(mid.to(tl.int32), 0) - 1
                tl.store(cand_ptr + (row * num_chunks + c) * chunk + dst, idx, mask=mid)
                n += k
    if KIND == 2:
        tl.atomic_add(hist_ptr + row * NB + tl.arange(0, NB), hist, mask=hist > 0, sem="relaxed")
    if KIND == 7:
        m, at = tl.max(win, 0, return_indices=True)
        n += tl.sum(tl.where(tl.arange(0, BLOCK) == at, arg, 0), 0)
        acc = tl.where(acc > -1e30, acc, 0.0)
    tl.store(out_ptr + row * num_chunks + c, tl.max(best, 0) + tl.sum(acc, 0) + n)


VARIANTS = {"read": (0, 16), "exp": (1, 16), "hist16": (2, 16), "hist64": (2, 64), "hist256": (2, 256),
            "masked8": (3, 16), "philox+gumbel": (4, 16), "philox": (5, 16), "compact": (6, 16),
            "scan (max, noisy winner, runner-up)": (7, 16)}


def run(rows: int, name: str, inputs: list[torch.Tensor], reps: int = 4) -> float:
    kind, nb = VARIANTS[name]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    c = max(1, min(triton.cdiv(VOCAB, BLOCK), triton.cdiv(8 * sms, rows)))
    chunk = triton.cdiv(triton.cdiv(VOCAB, c), BLOCK) * BLOCK
    c = triton.cdiv(VOCAB, chunk)
    out = torch.empty(rows, c, device="cuda")
    hist = torch.zeros(rows, nb, dtype=torch.int32, device="cuda")
    cand = torch.empty(rows, c, chunk, dtype=torch.int32, device="cuda")

    def call(x):
        _pass[(rows, c)](x, out, hist, cand, VOCAB, chunk, c, x.stride(0), KIND=kind, NB=nb, BLOCK=BLOCK,
                         num_warps=4)
    return time_calls(call, inputs, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--out")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = {}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; us per call")
    print("| variant | " + " | ".join(f"rows {r}" for r in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    inputs = {r: [torch.randn(r, VOCAB, generator=gen, device="cuda") * 2.5 for _ in range(COPIES)] for r in args.rows}
    for name in VARIANTS:
        row = {r: run(r, name, inputs[r]) for r in args.rows}
        results[name] = row
        print(f"| {name} | " + " | ".join(f"{row[r]:.1f}" for r in args.rows) + " |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "triton": triton.__version__, "us": results}, f, indent=1)


if __name__ == "__main__":
    main()
