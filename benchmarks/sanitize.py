"""compute-sanitizer over every kernel and step kind: one table of findings, exit 1 on any.

    python benchmarks/sanitize.py [--tools memcheck initcheck racecheck synccheck] [--out sanitize.json]

Runs this same file with ``--driver`` under each tool. The driver steps toy-llama (every backend
the device has) and toy Phi-3-Small (block-sparse + dense) in bf16: padded mode, then captured
graphs (capture included) and their replays; each with a mixed step padded to 64 tokens, one
padded to 16, a chunked prefill with cached context, a decode padded to 4, a split-KV decode at
long context, and one ``compile=True`` step. The table gives tool x kernel x count with the first
source line of each. It needs a CUDA GPU and ``compute-sanitizer`` (CUDA's, or on PATH).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

TOOLS = ("memcheck", "initcheck", "racecheck", "synccheck")
_HEADER = re.compile(r"^========= (?!\s)(?!ERROR SUMMARY)(?!RACECHECK SUMMARY)(.+)$")
_AT = re.compile(r"^=========\s+at (?:0x[0-9a-f]+ in )?([^\s+]+)(?:\+0x[0-9a-f]+)?(?: in (\S+))?")
_SUMMARY = re.compile(r"(?:ERROR|RACECHECK) SUMMARY: (\d+)")


def drive(quick: bool) -> None:
    import torch

    import fullgraph as fg

    def steps(runner) -> None:
        gen = torch.Generator().manual_seed(0)

        def ids(n):
            return torch.randint(1, 500, (n,), generator=gen).tolist()
        reqs = [runner.blocks.allocate(20) for _ in range(4)]
        runner.step([fg.SeqChunk(ids(n), 0, b) for n, b in zip((20, 9, 21), reqs)])          # mixed, padded to 64
        runner.step([fg.SeqChunk(ids(5), 20, reqs[0]), fg.SeqChunk(ids(1), 9, reqs[1]),      # chunked prefill with
                     fg.SeqChunk(ids(3), 0, reqs[3])])                                      # context, padded to 16
        for i in range(2):                                                                  # decode, padded to 4
            runner.step([fg.SeqChunk(ids(1), p + i, b) for p, b in zip((25, 10, 21), reqs)])
        long = runner.blocks.allocate(20)
        for pos in range(0, 300, 100):                                                      # long context, then
            runner.step([fg.SeqChunk(ids(100), pos, long)])                                 # split-KV decode
        for i in range(3):
            runner.step([fg.SeqChunk(ids(1), 300 + i, long)])
        torch.cuda.synchronize()

    models = {"toy-llama": fg.models.Llama(fg.models.LlamaConfig.toy(), dtype=torch.bfloat16, device="cuda"),
              "toy-phi3-small": fg.models.Phi3Small(fg.models.Phi3SmallConfig.toy(), dtype=torch.bfloat16, device="cuda")}
    limits = dict(max_num_seqs=8, max_num_tokens=128, max_model_len=320, capture_sizes=(4, 16, 64, 128))
    for name, model in models.items():
        backends = ["sdpa", "triton", "flash"] if name == "toy-llama" else ["sdpa", "triton"]
        for backend in backends[1:2] if quick else backends:
            for mode in ("padded", "full"):
                print(f"driver: {name} {backend} {mode}", flush=True)
                steps(fg.FullGraphRunner(model, attention=backend, cudagraph=mode, **limits))
        if quick:
            continue
        runner = fg.FullGraphRunner(model, attention="triton", cudagraph="full", compile=True, **limits)
        print(f"driver: {name} triton full compile", flush=True)
        ids = runner.blocks.allocate(4)
        runner.step([fg.SeqChunk([1, 2, 3], 0, ids)])
        torch.cuda.synchronize()


def sanitizer() -> str:
    found = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not Path(found).exists():
        raise SystemExit("compute-sanitizer not found (CUDA's, or on PATH)")
    return found


def run_tool(tool: str, timeout: int, quick: bool) -> dict:
    cmd = [sanitizer(), "--tool", tool, "--print-limit", "2000", "--target-processes", "all", sys.executable,
           __file__, "--driver"] + (["--quick"] if quick else [])
    if tool == "memcheck":
        cmd[1:1] = ["--leak-check", "no"]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        out, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        out, rc = (err.stdout or b"").decode() + (err.stderr or b"").decode(), -1
    kernels, first, kinds = Counter(), {}, defaultdict(Counter)
    lines = out.splitlines()
    for i, line in enumerate(lines):
        head = _HEADER.match(line)
        if not head:
            continue
        at = next((_AT.match(l) for l in lines[i + 1: i + 4] if _AT.match(l)), None)
        kernel = at.group(1) if at else "?"
        kernels[kernel] += 1
        kinds[kernel][head.group(1).strip()[:60]] += 1
        first.setdefault(kernel, (at.group(2) if at and at.group(2) else "?"))
    total = sum(int(m.group(1)) for m in _SUMMARY.finditer(out))
    first_block = "\n".join([l for l in lines if l.startswith("=========")][:40])
    return {"tool": tool, "total": total, "rc": rc, "seconds": time.perf_counter() - start, "kernels": dict(kernels),
            "first_line": first, "kinds": {k: dict(v) for k, v in kinds.items()}, "first_block": first_block,
            "tail": "\n".join(l for l in lines if not l.startswith("=========") and "driver:" not in l)[-1500:]}


def main() -> int:
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tools", nargs="+", default=list(TOOLS), choices=TOOLS)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per tool")
    parser.add_argument("--quick", action="store_true", help="toy-llama and toy Phi-3-Small on the triton backend only")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.driver:
        drive(args.quick)
        return 0
    results = [run_tool(tool, args.timeout, args.quick) for tool in args.tools]
    print(f"{'tool':<10} {'findings':>9} {'kernel':<40} {'count':>7}  first source line")
    for r in results:
        if not r["kernels"]:
            print(f"{r['tool']:<10} {r['total']:>9} {'-':<40} {'-':>7}  (exit {r['rc']}, {r['seconds']:.0f} s)")
        for kernel, count in sorted(r["kernels"].items(), key=lambda kv: -kv[1]):
            print(f"{r['tool']:<10} {r['total']:>9} {kernel[:40]:<40} {count:>7}  {r['first_line'][kernel]}"
                  f"  {list(r['kinds'][kernel])[:2]}")
        if r["rc"] not in (0,) and not r["kernels"]:
            print(f"           driver output: {r['tail'][-600:]}")
    for r in results:  # the first findings in full, to locate them
        if r["kernels"]:
            print(f"--- {r['tool']}: first findings ---\n{r['first_block']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 1 if any(r["total"] or r["kernels"] or r["rc"] for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
