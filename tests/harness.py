"""The toy-llama regression harness: one model, a reference runner and a runner under test.

``Twin`` runs every step on both runners (each with its own KV cache, allocated identically) and
returns both outputs. The reference is always ``cudagraph="none"`` with the same backend, so a
difference isolates padding (``"padded"``) or capture (``"full"``) bugs.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

import fullgraph as fg

HAS_CUDA = torch.cuda.is_available()
LIMITS = dict(max_num_seqs=8, max_num_tokens=128, max_model_len=256, block_size=16)


@dataclass(frozen=True)
class Mode:
    cudagraph: str
    attention: str = "sdpa"
    compile: bool = False
    dtype: torch.dtype = torch.float32

    @property
    def id(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return f"{self.cudagraph}-{self.attention}{'-compile' if self.compile else ''}-{dt}"


def _triton_on_cpu() -> bool:
    """The Triton backend runs interpreted on the CPU (slow); FULLGRAPH_TEST_TRITON=0 leaves it out."""
    return os.environ.get("FULLGRAPH_TEST_TRITON", "1") == "1"


# THE list of (backend, mode) the test suite runs: the conformance scenarios (test_regression)
# and every per-mode test (modes_under_test) use it.
class BlockSparseTorch(fg.attention.backends.get_backend_class("blocksparse")):
    """The block-sparse backend on its plain-PyTorch path (its kernels run interpreted on the CPU,
    minutes for the suite; test_blocksparse checks them against this path)."""

    impl_choice = "torch"


# (backend, mode, dtype or None, model preset or None: the suite's default)
_CPU = [("sdpa", "padded", None, None), ("sdpa", "compile", None, None), (BlockSparseTorch, "padded", None, None),
        ("sdpa", "padded", None, "toy-mistral")] + \
       ([("triton", "padded", None, None), ("triton", "padded", None, "toy-mistral")] if _triton_on_cpu() else [])
_GPU = [("sdpa", "full", None, None), ("triton", "full", None, None), ("flash", "full", torch.bfloat16, None),
        ("blocksparse", "full", torch.bfloat16, None), ("triton", "compile", None, None),
        ("triton", "full", None, "toy-mistral"), ("flash", "full", torch.bfloat16, "toy-mistral")]
CONFORMANCE_CASES = [pytest.param(c, id=f"{getattr(c[0], 'name', c[0])}-{c[1]}" + ("-bf16" if c[2] else "")
                                  + (f"-{c[3]}" if c[3] else "")) for c in (_GPU if HAS_CUDA else _CPU)]


def modes_under_test() -> list[Mode]:
    """The dense (backend, mode) pairs of ``CONFORMANCE_CASES`` as runner modes (compiled modes
    included on the GPU only: on the CPU each compiled runner costs seconds) whose backend serves
    steps with cached context (decode steps: FlashAttention without paging serves prompts only)."""
    out = []
    for param in CONFORMANCE_CASES:
        backend, mode, dtype, preset = param.values[0]
        if not isinstance(backend, str) or backend == "blocksparse" or preset or (mode == "compile" and not HAS_CUDA):
            continue
        cudagraph = "full" if HAS_CUDA else "padded"
        out.append(Mode(cudagraph, backend, compile=mode == "compile", dtype=dtype or torch.float32))
    backends = fg.attention.backends
    return [m for m in out if m.attention in backends.available_backends()
            and backends.backend_class(m.attention).supports_context()]


@functools.lru_cache(maxsize=4)
def toy_model(dtype: torch.dtype = torch.float32) -> fg.models.Llama:
    return fg.models.Llama(fg.models.LlamaConfig.toy(), dtype=dtype, device="cuda" if HAS_CUDA else "cpu", seed=0)


def make_runner(mode: Mode, cudagraph: str | None = None, **overrides) -> fg.FullGraphRunner:
    kwargs = {**LIMITS, **overrides}
    return fg.FullGraphRunner(toy_model(mode.dtype), cudagraph=cudagraph or mode.cudagraph,
                              attention=mode.attention, compile=mode.compile, **kwargs)


@dataclass
class Request:
    """A request's tokens so far and its pages (the same ids in both runners of a twin)."""

    blocks: list[int]
    pos: int = 0
    tokens: list[int] = field(default_factory=list)


class Twin:
    def __init__(self, mode: Mode, validate: bool = True, **overrides) -> None:
        """``validate``: the runner under test runs in strict mode (poisoned tails, null block and
        output; invariant, address and KV-write checks on every step)."""
        self.ref = make_runner(mode, cudagraph="none", **overrides)
        self.test = make_runner(mode, validate=validate, **overrides)
        self.rng = np.random.default_rng(0)

    def new_request(self, max_len: int) -> Request:
        n = -(-max_len // self.ref.config.block_size)
        ids = self.ref.blocks.allocate(n)
        assert self.test.blocks.allocate(n) == ids
        return Request(ids)

    def chunk(self, req: Request, n: int, tokens: list[int] | None = None) -> fg.SeqChunk:
        """The next ``n`` tokens of ``req`` (random unless given); advances the request."""
        tokens = tokens if tokens is not None else self.rng.integers(0, 512, n).tolist()
        chunk = fg.SeqChunk(tokens, req.pos, req.blocks)
        req.pos += n
        req.tokens += tokens
        return chunk

    def step(self, chunks: list[fg.SeqChunk]) -> tuple[fg.StepOutput, fg.StepOutput]:
        ref, got = self.ref.step(chunks), self.test.step(chunks)
        cfg = self.test.config
        if cfg.cudagraph == "full" and got.num_tokens <= cfg.buckets[-1]:
            assert got.mode == "full", f"a {got.num_tokens}-token step did not replay a graph"
        return ref, got


def assert_logits_close(ref: fg.StepOutput, got: fg.StepOutput, dtype=torch.float32) -> None:
    assert got.logits.shape == ref.logits.shape
    assert torch.isfinite(got.logits).all(), "NaN/inf in real logits"
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    scale = ref.logits.abs().max().clamp(min=1.0)
    err = ((got.logits - ref.logits).abs().max() / scale).item()
    assert err <= tol, f"max relative |delta| {err:.3g} > {tol:g} (ran as {got.mode}, bucket {got.num_tokens_padded})"


def kv_bytes(runner: fg.FullGraphRunner) -> list[torch.Tensor]:
    return [c.detach().view(torch.uint8).cpu().clone() for c in runner.kv_caches]
