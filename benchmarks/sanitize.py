"""compute-sanitizer over every kernel and step kind: one table of findings, exit 1 on any.

    python benchmarks/sanitize.py [--tools memcheck initcheck racecheck synccheck] [--out sanitize.json]
    python benchmarks/sanitize.py --probe --tools initcheck      # isolated producer -> consumer pairs

Runs this same file with ``--driver`` under each tool. The driver steps toy-llama (every backend
the device has) and toy Phi-3-Small (block-sparse + dense) in bf16: padded mode, then captured
graphs (capture included) and their replays; each with a mixed step padded to 64 tokens, one
padded to 16, a chunked prefill with cached context, a decode padded to 4, a split-KV decode at
long context, and one ``compile=True`` step. The table gives tool x kernel x count with the first
source line of each, and per driver phase (``driver: ...`` lines) where the findings fell.
``--probe`` runs small producer -> consumer pairs instead (cuBLAS or our Triton kernels writing,
ours or PyTorch's reading; eager and in a CUDA graph), each its own phase, to tell a finding of
the code from one of the tool. It needs a CUDA GPU and ``compute-sanitizer`` (CUDA's, or on PATH).
"""
from __future__ import annotations

import argparse
import contextlib
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
_HEADER = re.compile(r"^========= (?!\s)(?!ERROR SUMMARY)(?!RACECHECK SUMMARY)(?!COMPUTE-SANITIZER\s*$)(.+)$")
_AT = re.compile(r"^=========\s+at (?:0x[0-9a-f]+ in )?(?:void )?(.+?)(?:\(.*?)?(?:\+0x[0-9a-f]+)?(?: in (\S+))?\s*$")
_SUMMARY = re.compile(r"(?:ERROR|RACECHECK) SUMMARY: (\d+)")


def zero_matmul_outputs():
    """A function mode that has cuBLAS write every matrix product (``F.linear``, ``@``, ``mm``,
    ``matmul``) into memory zero-filled first (the ``out=`` form). initcheck does not see cuBLAS's
    stores on Hopper, so a kernel reading a product in memory nothing else wrote is flagged,
    PyTorch's own kernels alike (``--probe`` shows it); under this mode such reads are of
    initialised memory, and what initcheck still finds is a read those stores do not explain.
    ``F.scaled_dot_product_attention`` (the reference backend) runs on PyTorch's FlashAttention
    kernel instead of cuDNN's meanwhile, for the same reason.
    A function mode, not a dispatch mode: under a dispatch mode our custom ops run as registered
    ops, and the products inside them would escape it."""
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    def product(a, b, bias=None):   # a (..., K) @ b (K, N) [+ bias] into zeros
        rows = a.reshape(-1, a.shape[-1])
        out = torch.zeros(rows.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
        if bias is None:
            torch.mm(rows, b, out=out)
        else:
            torch.addmm(bias, rows, b, out=out)
        return out.view(*a.shape[:-1], b.shape[1])

    matmuls = {torch.mm, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.mm}

    class ZeroMatmulOutputs(TorchFunctionMode):
        def __enter__(self):   # and PyTorch's attention on its FlashAttention kernel, not cuDNN's
            self.cudnn_sdp = torch.backends.cuda.cudnn_sdp_enabled()
            torch.backends.cuda.enable_cudnn_sdp(False)
            return super().__enter__()

        def __exit__(self, *exc):
            torch.backends.cuda.enable_cudnn_sdp(self.cudnn_sdp)
            return super().__exit__(*exc)

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.linear and not kwargs and args[0].is_cuda and args[1].dim() == 2:
                return product(args[0], args[1].t(), args[2] if len(args) > 2 else None)
            if (func in matmuls and not kwargs and len(args) == 2 and args[0].is_cuda and args[1].dim() == 2
                    and args[0].dim() >= 2):
                return product(args[0], args[1])
            return func(*args, **kwargs)

    return ZeroMatmulOutputs()


def drive(quick: bool, only: str | None = None, zero_matmul: bool = False) -> None:
    import torch

    import fullgraph as fg

    control = zero_matmul_outputs if zero_matmul else contextlib.nullcontext

    def steps(runner) -> None:
        gen = torch.Generator().manual_seed(0)

        def ids(n):
            return torch.randint(1, 500, (n,), generator=gen).tolist()
        count = iter(range(100))
        step = runner.step

        skipped = []

        def logged(chunks):  # "step: N" lines place a finding within a phase
            n = next(count)
            if skipped:  # the steps after a skipped one would find its tokens missing
                print(f"step: {n} skipped (after step {skipped[0]})", flush=True)
                return None
            print(f"step: {n}", flush=True)
            try:
                return step(chunks)
            except ValueError as err:  # a backend that cannot run this step here (flash on an old torch)
                if "cannot run this step" not in str(err):
                    raise
                skipped.append(n)
                print(f"step: {n} skipped: {err}", flush=True)
        runner.step = logged
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
                if only and only not in f"{name} {backend} {mode}":
                    continue
                print(f"driver: {name} {backend} {mode}", flush=True)
                with control():
                    steps(fg.FullGraphRunner(model, attention=backend, cudagraph=mode, **limits))
        if quick or only or zero_matmul:   # the compile=True steps run without the control
            continue
        runner = fg.FullGraphRunner(model, attention="triton", cudagraph="full", compile=True, **limits)
        print(f"driver: {name} triton full compile", flush=True)
        ids = runner.blocks.allocate(4)
        runner.step([fg.SeqChunk([1, 2, 3], 0, ids)])
        torch.cuda.synchronize()


def probe() -> None:
    """Producer -> consumer pairs, one phase each (see the module docstring)."""
    import torch
    import torch.nn.functional as F

    from fullgraph import kernels

    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    def phase(name, fn):
        print(f"driver: probe {name}", flush=True)
        fn()
        torch.cuda.synchronize()

    cos, sin = randn(128, 8, dtype=torch.float32), randn(128, 8, dtype=torch.float32)
    pos = torch.arange(64, device="cuda")

    def gemm_then_rope(dtype, m=64):
        def run():
            qkv = F.linear(randn(m, 64, dtype=dtype), randn(128, 64, dtype=dtype))    # cuBLAS
            q, k, _ = qkv.split((64, 32, 32), dim=-1)
            kernels.rope(q.view(m, 4, 16), k.view(m, 2, 16), torch.arange(m, device="cuda"), cos, sin)
        return run

    def gemm_then_torch():
        qkv = F.linear(randn(64, 64), randn(128, 64))
        (qkv[:, :64].float() * 2).sum()

    def fill_then_rope():
        qkv = torch.empty(64, 128, dtype=torch.bfloat16, device="cuda")
        qkv.copy_(randn(64, 128))                                                    # a PyTorch kernel writes
        q, k, _ = qkv.split((64, 32, 32), dim=-1)
        kernels.rope(q.view(64, 4, 16), k.view(64, 2, 16), pos, cos, sin)

    def norm_then_gather():
        y = kernels.rms_norm(randn(64, 64), randn(64), 1e-5)                          # Triton writes
        y[torch.tensor([3, 9, 63], device="cuda")].sum()                              # PyTorch gathers

    def norm_then_gather_graph():
        x, w, idx = randn(64, 64), randn(64), torch.tensor([3, 9, 63], device="cuda")
        out = torch.empty(3, 64, dtype=torch.bfloat16, device="cuda")

        def step():
            out.copy_(kernels.rms_norm(x, w, 1e-5)[idx])
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for _ in range(2):
            graph.replay()

    def layer_chain(pad_to=64, real=50):
        """A decoder layer's first launches on fresh memory, as the model makes them: our norm,
        cuBLAS's QKV projection, our fused RoPE + KV write (padded rows with slot -1)."""
        def run():
            h = kernels.rms_norm(randn(pad_to, 64), randn(64), 1e-5)
            qkv = F.linear(h, randn(128, 64))
            q, k, v = qkv.split((64, 32, 32), dim=-1)
            cache = torch.zeros(2, 8, 16, 2, 16, dtype=torch.bfloat16, device="cuda")
            slots = torch.full((pad_to,), -1, dtype=torch.int64, device="cuda")
            slots[:real] = torch.randperm(8 * 16, device="cuda")[:real]
            kernels.rope_kv_write(query=q.view(pad_to, 4, 16), key=k.view(pad_to, 2, 16), value=v.view(pad_to, 2, 16),
                                  kv_cache=cache, slot_mapping=slots, positions=torch.arange(pad_to, device="cuda"),
                                  cos=cos, sin=sin)
        return run

    def fresh(producer: str, consumer: str):
        """A producer writing a (64, 128) bf16 output into memory nothing wrote before (a new
        allocation after ``empty_cache``), then a consumer reading it. The other probes' outputs
        can land in blocks earlier temporaries wrote, which hides a write the tool does not see."""
        def run():
            a, b = randn(64, 64), randn(128, 64)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            out = torch.empty(24 << 20, dtype=torch.uint8, device="cuda")[: 64 * 128 * 2].view(torch.bfloat16).view(64, 128)
            if producer == "cublas":
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    torch.mm(a, b.t(), out=out)
                    torch.cuda.synchronize()
                print("probe: cuBLAS kernels " + ", ".join(e.name[:120] for e in prof.events() if e.device_type.name == "CUDA"),
                      flush=True)
            else:
                out.copy_(randn(64, 128))
            if consumer == "rope":
                q, k, _ = out.split((64, 32, 32), dim=-1)
                kernels.rope(q.view(64, 4, 16), k.view(64, 2, 16), pos, cos, sin)
            else:
                out.float().sum()
        return run

    for producer, consumer in (("cublas", "rope"), ("cublas", "torch"), ("copy", "rope")):
        phase(f"fresh memory: {producer} -> {consumer}", fresh(producer, consumer))
    phase("rms_norm -> cublas -> rope_kv_write", layer_chain())
    phase("cublas-bf16 -> rope", gemm_then_rope(torch.bfloat16))
    phase("cublas-fp32 -> rope", gemm_then_rope(torch.float32))
    for m in (4, 16, 128):
        phase(f"cublas-bf16 M={m} -> rope", gemm_then_rope(torch.bfloat16, m))
    phase("cublas-bf16 -> torch", gemm_then_torch)
    phase("copy -> rope", fill_then_rope)
    phase("rms_norm -> gather", norm_then_gather)
    phase("rms_norm -> gather, graph", norm_then_gather_graph)


def trace(mode: str = "print") -> None:
    """toy-llama, triton, padded: construction, warm-up and the first two steps with every
    operator's tensors printed (address range, shape, strides) and the project line that called
    it, so a finding's address names the tensor, the operator that made it and its caller.
    ``mode`` "quiet" keeps the dispatch mode but prints nothing, "off" runs without one: the same
    steps, to tell a finding that the tracing changes (its timing, or the custom-op path it forces);
    "nowarm" prints but skips the warm-up, so the steps run on memory nothing wrote before (as
    the driver's padded phases do)."""
    import traceback

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import fullgraph as fg

    root = str(Path(fg.__file__).parent)

    def span(t):
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
            return None
        end = t.data_ptr() + max(0, sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()
        return f"{t.data_ptr():#x}-{end + t.element_size():#x} {tuple(t.shape)} {t.stride()} {str(t.dtype)[6:]}"

    def caller() -> str:
        frames = [f for f in traceback.extract_stack()[:-3] if f.filename.startswith(root)]
        return " < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-3:][::-1])

    class Trace(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if mode == "quiet":
                return out
            flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
            outs = torch.utils._pytree.tree_leaves(out)
            print(f"trace: {func} out {[span(t) for t in outs if span(t)]} in {[span(t) for t in flat if span(t)]} "
                  f"at {caller()}", flush=True)
            return out

    if mode == "off":
        Trace = contextlib.nullcontext  # noqa: N806
    print("driver: trace construction", flush=True)
    with Trace():
        model = fg.models.Llama(fg.models.LlamaConfig.toy(), dtype=torch.bfloat16, device="cuda")
        runner = fg.FullGraphRunner(model, attention="triton", cudagraph="padded", max_num_seqs=8, max_num_tokens=128,
                                    max_model_len=320, capture_sizes=(4, 16, 64, 128))
        torch.cuda.synchronize()
    print("driver: trace warm-up", flush=True)
    with Trace():
        if mode != "nowarm":
            runner.warmup()
        torch.cuda.synchronize()
    gen = torch.Generator().manual_seed(0)
    reqs = [runner.blocks.allocate(20) for _ in range(4)]
    steps = [[(20, 0, 0), (9, 0, 1), (21, 0, 2)], [(5, 20, 0), (1, 9, 1), (3, 0, 3)]]
    for i, step in enumerate(steps):
        print(f"driver: trace step {i}", flush=True)
        with Trace():
            runner.step([fg.SeqChunk(torch.randint(1, 500, (n,), generator=gen).tolist(), pos, reqs[r])
                         for n, pos, r in step])
            torch.cuda.synchronize()


def sanitizer() -> str:
    found = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not Path(found).exists():
        raise SystemExit("compute-sanitizer not found (CUDA's, or on PATH)")
    return found


def run_tool(tool: str, timeout: int, driver_args: list[str]) -> dict:
    cmd = [sanitizer(), "--tool", tool, "--print-limit", "2000", "--show-backtrace", "no", "--target-processes", "all", sys.executable,
           __file__, "--driver"] + driver_args
    if tool == "memcheck":
        cmd[1:1] = ["--leak-check", "no"]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        out, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as err:
        out, rc = (err.stdout or b"").decode() + (err.stderr or b"").decode(), -1
    return {"tool": tool, "rc": rc, "seconds": time.perf_counter() - start, **parse(out)}


def parse(out: str) -> dict:
    """A tool's output -> findings: total (its summary line), kernel -> count, each kernel's first
    source line and kinds of finding, the findings per driver phase, the first findings in full."""
    kernels, first, kinds, phases = Counter(), {}, defaultdict(Counter), defaultdict(Counter)
    lines, phase = out.splitlines(), "start"
    for i, line in enumerate(lines):
        if line.startswith("driver: "):
            phase = line[len("driver: "):].strip()
        head = _HEADER.match(line)
        if not head:
            continue
        at = next((_AT.match(l) for l in lines[i + 1: i + 4] if _AT.match(l)), None)
        kernel = at.group(1) if at else "?"
        kernels[kernel] += 1
        phases[phase][kernel[:60]] += 1
        kinds[kernel][head.group(1).strip()[:60]] += 1
        first.setdefault(kernel, (at.group(2) if at and at.group(2) else "?"))
    total = sum(int(m.group(1)) for m in _SUMMARY.finditer(out))
    first_block = "\n".join([l for l in lines if l.startswith("=========")][:40])
    return {"total": total, "kernels": dict(kernels),
            "first_line": first, "kinds": {k: dict(v) for k, v in kinds.items()}, "first_block": first_block,
            "phases": {k: dict(v) for k, v in phases.items()},
            "tail": "\n".join(l for l in lines if not l.startswith("=========") and "driver:" not in l)[-1500:]}


def main() -> int:
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tools", nargs="+", default=list(TOOLS), choices=TOOLS)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per tool")
    parser.add_argument("--quick", action="store_true", help="toy-llama and toy Phi-3-Small on the triton backend only")
    parser.add_argument("--probe", action="store_true", help="isolated producer -> consumer pairs instead")
    parser.add_argument("--zero-matmul-outputs", action="store_true",
                        help="a control for initcheck: cuBLAS writes every matrix product into zero-filled memory "
                             "(initcheck does not see its stores); the compile=True steps are left out")
    parser.add_argument("--trace", nargs="?", const="print", default=None, choices=("print", "quiet", "off", "nowarm"),
                        help=argparse.SUPPRESS)  # with --driver: trace(mode)
    parser.add_argument("--only", default=None, help="run only the driver phases whose 'model backend mode' "
                                                     "contains this text (e.g. 'toy-llama triton padded')")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.driver:
        trace(args.trace) if args.trace else probe() if args.probe else drive(args.quick, args.only,
                                                                                     args.zero_matmul_outputs)
        return 0
    driver_args = (["--quick"] * args.quick + ["--probe"] * args.probe + (["--only", args.only] if args.only else [])
                   + ["--zero-matmul-outputs"] * args.zero_matmul_outputs)
    results = [run_tool(tool, args.timeout, driver_args) for tool in args.tools]
    print(f"{'tool':<10} {'findings':>9} {'kernel':<40} {'count':>7}  first source line")
    for r in results:
        if not r["kernels"]:
            print(f"{r['tool']:<10} {r['total']:>9} {'-':<40} {'-':>7}  (exit {r['rc']}, {r['seconds']:.0f} s)")
        for kernel, count in sorted(r["kernels"].items(), key=lambda kv: -kv[1]):
            print(f"{r['tool']:<10} {r['total']:>9} {kernel[:40]:<40} {count:>7}  {r['first_line'][kernel]}"
                  f"  {list(r['kinds'][kernel])[:2]}")
        if r["rc"] not in (0,) and not r["kernels"]:
            print(f"           driver output: {r['tail'][-600:]}")
    for r in results:  # where they fell
        for phase, found in r["phases"].items():
            print(f"{r['tool']:<10} in {phase}: " + ", ".join(f"{k} x{n}" for k, n in found.items()))
    for r in results:  # the first findings in full, to locate them
        if r["kernels"]:
            print(f"--- {r['tool']}: first findings ---\n{r['first_block']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 1 if any(r["total"] or r["kernels"] or r["rc"] for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
