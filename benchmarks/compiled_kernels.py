"""The decode step's Triton kernels as an H100/H200 would run them, built on a machine without a GPU.

Triton's NVIDIA backend lowers a kernel to TTGIR and PTX without a device, and the ``ptxas`` it
ships assembles the PTX: so a CPU machine can see, per compiled variant, its registers (which bound
how many programs share an SM), spills, shared memory, and the layout conversions the compiler
inserted (``ttg.convert_layout``: a round trip through shared memory and a barrier), counting those
inside loops apart. Nothing is launched: each kernel's launcher runs with CPU tensors while a
stand-in driver reports an sm_90 target and Triton compiles the variant ("warm-up") instead of
launching it.

    python benchmarks/compiled_kernels.py [--arch 90] [--out kernels.json]

Shapes: llama-1b's (hidden 2048, 32 query / 8 KV heads of 64, MLP 8192) at one row and at 8 and
32 rows, SmolLM2's attention, sampling at vocab 128,256 and 32 rows. Prints a table; ``--out``
writes it as JSON. Relies on Triton internals (``triton.runtime.driver.set_active``,
``JITFunction.run(warmup=True)``): a Triton release that changes them makes this script say so.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)   # compile for the GPU target, not the interpreter

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

BF16 = torch.bfloat16


class _TargetOnly:
    """Enough of a Triton driver to compile for ``arch`` without a device."""

    def __init__(self, arch: int) -> None:
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def _ptxas() -> str:
    base = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):   # the newer one reads the newer PTX versions
        if os.path.exists(os.path.join(base, name)):
            return os.path.join(base, name)
    raise FileNotFoundError(f"no ptxas under {base}")


def _loop_conversions(ttgir: str) -> int:
    """``convert_layout`` ops inside ``scf.for`` regions: a line ending in ``{`` opens a region (a
    loop's if it holds ``scf.for``), a line starting with ``}`` closes the innermost one."""
    regions, count = [], 0
    for line in ttgir.splitlines():
        text = line.strip()
        if text.startswith("}") and regions:
            regions.pop()
        if "ttg.convert_layout" in text and "for" in regions:
            count += 1
        if text.endswith("{"):
            regions.append("for" if "scf.for" in text else "other")
    return count


class Recorder:
    """Replaces a JITFunction's launch with a compile, and records what the compiled variant holds."""

    def __init__(self, arch: int) -> None:
        self.arch, self.rows, self.case = arch, [], ""
        self.ptxas = _ptxas()

    def watch(self, kernel) -> None:
        jit = kernel
        while hasattr(jit, "fn") and not hasattr(jit, "run"):   # compile_ahead.Kernel wraps the JITFunction
            jit = jit.fn
        original = jit.run

        def compile_only(*args, grid, warmup, **kwargs):
            compiled = original(*args, grid=grid, warmup=True, **kwargs)
            if compiled is not None:
                self._record(compiled)
            return None
        jit.run = compile_only

    def _record(self, compiled) -> None:
        ttgir = compiled.asm["ttgir"]
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "k.ptx"), "w") as f:
                f.write(compiled.asm["ptx"])
            out = subprocess.run([self.ptxas, "-v", f"--gpu-name=sm_{self.arch}a", os.path.join(d, "k.ptx"),
                                  "-o", os.path.join(d, "k.cubin")], capture_output=True, text=True)
        text = out.stdout + out.stderr
        regs, spills = re.search(r"Used (\d+) registers", text), re.search(r"(\d+) bytes spill stores", text)
        self.rows.append({"case": self.case, "kernel": compiled.name, "num_warps": compiled.metadata.num_warps,
                          "registers": int(regs.group(1)) if regs else None,
                          "spill_bytes": int(spills.group(1)) if spills else None,
                          "shared_bytes": compiled.metadata.shared,
                          "conversions": ttgir.count("ttg.convert_layout"),
                          "conversions_in_loops": _loop_conversions(ttgir)})


def _cases(rec: Recorder) -> None:
    from fullgraph.kernels import pdl
    pdl.options = lambda t: {"USE_PDL": True, "launch_pdl": True}   # as on a GPU that has it
    linear = importlib.import_module("fullgraph.kernels.linear")
    rope_kv = importlib.import_module("fullgraph.kernels.linear_rope_kv")
    skinny = importlib.import_module("fullgraph.kernels.skinny_linear")
    attention = importlib.import_module("fullgraph.kernels.paged_attention")
    reduce = importlib.import_module("fullgraph.kernels.split_kv_reduce")
    sampling = importlib.import_module("fullgraph.kernels.sampling")
    for kernel in (linear._linear_kernel, rope_kv._linear_rope_kv_kernel, skinny._skinny_kernel,
                   skinny._skinny_rope_kv_kernel, attention._paged_attention_kernel, reduce._split_kv_reduce_kernel,
                   sampling._scan_kernel, sampling._hist_kernel, sampling._tail_kernel, sampling._select_kernel):
        rec.watch(kernel)

    def qkv_args(rows: int) -> dict:
        angles = torch.rand(4096, 32)
        return dict(x=torch.randn(rows, 2048, dtype=BF16), w=torch.randn(3072, 2048, dtype=BF16), b=None,
                    norm_weight=torch.randn(2048, dtype=BF16), eps=1e-5,
                    kv_cache=torch.randn(2, 64, 16, 8, 64, dtype=BF16), slot_mapping=torch.arange(rows) + 16,
                    positions=torch.arange(rows), cos=angles.cos(), sin=angles.sin(), num_heads=32, num_kv_heads=8,
                    layout="llama")

    mlp = {"o_proj": (2048, 2048, "none", False, True), "gate_up": (16384, 2048, "silu_and_mul", True, False),
           "down_proj": (2048, 8192, "none", False, True)}
    for rows, launch in ((1, linear.launch), (8, skinny.launch), (32, skinny.launch)):
        rec.case = f"llama-1b qkv+rope, {rows} row{'s' * (rows > 1)}"
        (rope_kv.launch if rows == 1 else skinny.launch_rope_kv)(**qkv_args(rows))
        for name, (n, k, act, norm, res) in mlp.items():
            rec.case = f"llama-1b {name}, {rows} row{'s' * (rows > 1)}"
            launch(torch.randn(rows, k, dtype=BF16), torch.randn(n, k, dtype=BF16), None, act,
                   norm_weight=torch.randn(k, dtype=BF16) if norm else None, eps=1e-5,
                   residual=torch.randn(rows, n, dtype=BF16) if res else None)

    def attend(label: str, rows: int, heads: int, kv_heads: int, splits: int, merge: bool) -> None:
        rec.case = label
        pages = 64
        attention.paged_attention(
            torch.randn(rows, heads, 64, dtype=BF16), torch.randn(2, rows * pages + 1, 16, kv_heads, 64, dtype=BF16),
            torch.arange(rows + 1, dtype=torch.int32), torch.full((rows,), 1024, dtype=torch.int32),
            torch.arange(rows * pages, dtype=torch.int32).reshape(rows, pages) + 1, scale=0.125, decode_only=True,
            num_splits=splits, part_out=torch.empty(rows * splits * heads * 64), part_lse=torch.empty(rows * splits * heads),
            arrivals=torch.zeros(rows * kv_heads, dtype=torch.int32) if merge else None, num_sms=132)

    attend("llama-1b decode attention, 1 row (16 splits)", 1, 32, 8, 16, False)
    attend("... the merge in the launch", 1, 32, 8, 16, True)
    attend("llama-1b decode attention, 32 rows", 32, 32, 8, 1, False)
    attend("SmolLM2 decode attention, 1 row (16 splits)", 1, 9, 3, 16, False)
    for label, params in (("sampling top-p 0.9, 32 rows", dict(top_k=0, top_p=0.9)),
                          ("sampling top-k 50 + top-p 0.95, 32 rows", dict(top_k=50, top_p=0.95))):
        rec.case = label
        rows = 32
        sampling.launch(torch.randn(rows, 128256), torch.ones(rows), torch.full((rows,), params["top_k"], dtype=torch.int32),
                        torch.full((rows,), params["top_p"]), torch.zeros(rows), torch.arange(rows),
                        torch.zeros(rows, dtype=torch.int64))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability to build for (90: H100/H200)")
    parser.add_argument("--out", help="write the rows as JSON to this path")
    args = parser.parse_args(argv)
    try:
        driver.set_active(_TargetOnly(args.arch))
        rec = Recorder(args.arch)
        _cases(rec)
    except (AttributeError, TypeError, FileNotFoundError) as err:
        raise SystemExit(f"compiled_kernels: this Triton ({triton.__version__}) does not compile without a "
                         f"device the way this script expects: {type(err).__name__}: {err}") from err
    from fullgraph.bench import _table
    _table(rec.rows, ["case", "kernel", "num_warps", "registers", "spill_bytes", "shared_bytes", "conversions",
                      "conversions_in_loops"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"triton": triton.__version__, "arch": args.arch, "rows": rec.rows}, f, indent=1)
    return rec.rows


if __name__ == "__main__":
    main()
