"""The conformance harness: one backend and one model, a reference runner and a runner under test.

A :class:`Case` fixes what is tested: the attention backend (or a kind -> backend mapping), the
model, the device and dtype, and the mode ("padded", "full" or "compile"). A :class:`Twin` runs
every step on two runners of the case — the unpadded eager reference (``cudagraph="none"``, the
*same* backend, so a backend is judged against itself) and the runner under test, each with its
own KV cache, allocated identically — and compares the logits of every real request.
Runners are cached per configuration and ``reset()`` between scenarios, so a suite captures and
compiles each configuration once.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ..plan import SeqChunk
from ..runner import FullGraphRunner, StepOutput

LIMITS = dict(max_num_seqs=8, max_num_tokens=128, max_model_len=256, block_size=16)


class ScenarioFailure(AssertionError):
    """A scenario found a violation; the message says what broke (request, field, index, layer)."""


@dataclass
class Case:
    """What one conformance run tests (see the module docstring)."""

    attention: object                      # str | type[AttentionBackend] | dict kind -> backend
    model: nn.Module
    mode: str                              # "padded" | "full" | "compile"
    seed: int = 0
    _runners: dict = field(default_factory=dict, repr=False)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def tolerance(self) -> float:
        """Relative tolerance on logits: float32 rounding, or half-precision rounding."""
        return 1e-5 if self.dtype in (torch.float32, torch.float64) else 5e-2

    def runner(self, test: bool, validate: bool = True, **overrides) -> FullGraphRunner:
        """The reference (``test=False``) or the runner under test for ``overrides`` of ``LIMITS``,
        built once per configuration and reset on every later request."""
        if test:
            cudagraph = "full" if self.mode == "full" or (self.mode == "compile" and self.device.type == "cuda") \
                else "padded"
            mode = dict(cudagraph=cudagraph, compile=self.mode == "compile", validate=validate)
        else:
            mode = dict(cudagraph="none", compile=False, validate=False)
        config = {**LIMITS, **overrides, **mode}
        key = tuple(sorted((k, repr(v)) for k, v in config.items()))
        runner = self._runners.get(key)
        if runner is None:
            runner = self._runners[key] = FullGraphRunner(self.model, attention=self.attention, **config)
        else:
            runner.reset()
        return runner

    def backend_classes(self) -> list[type]:
        """The classes of the backends this case's runners use (from a probe runner of its own,
        so asking never resets a runner a scenario holds)."""
        if "probe" not in self._runners:
            probe = FullGraphRunner(self.model, attention=self.attention, **LIMITS, cudagraph="none")
            self._runners["probe"] = [type(b) for b in probe.backends.values()]
        return self._runners["probe"]

    @property
    def layer_kinds(self) -> set[str]:
        return {layer.kind for layer in self.model.attention_layers()}

    @property
    def windows(self) -> set[int]:
        return {layer.sliding_window for layer in self.model.attention_layers() if layer.sliding_window}


@dataclass
class Request:
    """A request's position so far and its pages (the same ids in both runners of a twin)."""

    blocks: list[int]
    pos: int = 0


class Twin:
    """The reference and the runner under test of one case, stepped together."""

    def __init__(self, case: Case, validate: bool = True, **overrides) -> None:
        self.case = case
        self.ref = case.runner(False, **overrides)
        self.test = case.runner(True, validate=validate, **overrides)
        self.rng = np.random.default_rng(case.seed)
        self.vocab = int(case.model.vocab_size)

    def new_request(self, max_len: int) -> Request:
        n = -(-max_len // self.ref.config.block_size)
        ids = self.ref.blocks.allocate(n)
        if self.test.blocks.allocate(n) != ids:
            raise AssertionError("the two runners' allocators diverged")
        return Request(ids)

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(0, self.vocab, n).tolist()

    def chunk(self, req: Request, n: int, tokens: Sequence[int] | None = None) -> SeqChunk:
        """The next ``n`` tokens of ``req`` (random unless given); advances the request."""
        chunk = SeqChunk(list(tokens) if tokens is not None else self.tokens(n), req.pos, req.blocks)
        req.pos += n
        return chunk

    def step(self, chunks: list[SeqChunk], what: str = "step") -> tuple[StepOutput, StepOutput]:
        """Both runners run ``chunks``; raises ``ScenarioFailure`` if any real logits row differs."""
        ref, got = self.ref.step(chunks), self.test.step(chunks)
        cfg = self.test.config
        if cfg.cudagraph == "full" and got.num_tokens <= cfg.buckets[-1] and got.mode != "full":
            raise ScenarioFailure(f"{what}: a {got.num_tokens}-token step did not replay a graph (ran {got.mode})")
        compare(ref, got, self.case.tolerance, what, lambda: self._locate(chunks))
        return ref, got

    def _locate(self, chunks: list[SeqChunk]) -> str:
        """Where the two runners first diverge, by layer (``fullgraph.debug.compare``), best effort."""
        from ..debug import compare as debug_compare

        layers = getattr(self.case.model, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            return ""
        mode = {"padded": "padded", "full": "full", "compile": "compile"}[self.case.mode]
        try:
            report = debug_compare(self.ref, chunks, modes=("none", mode))
        except Exception as err:  # noqa: BLE001 (diagnosis only: never hide the failure itself)
            return f"; (layer search failed: {type(err).__name__}: {err})"
        first = report.modes[mode].first_divergent_layer
        return "" if first is None else f"; hidden states first diverge at decoder layer {first}"


def compare(ref: StepOutput, got: StepOutput, tol: float, what: str, locate: Callable[[], str] | None = None) -> None:
    """Raise ``ScenarioFailure`` naming the request if ``got``'s real logits are not ``ref``'s."""
    if got.logits.shape != ref.logits.shape:
        raise ScenarioFailure(f"{what}: logits shape {tuple(got.logits.shape)} != reference {tuple(ref.logits.shape)}")
    nan = torch.isnan(got.logits).any(-1)
    if nan.any():
        raise ScenarioFailure(f"{what}: NaN in the logits of request {int(nan.nonzero()[0])} "
                              f"(ran {got.mode}, bucket {got.num_tokens_padded})")
    same = got.logits == ref.logits  # masked ids are -inf in both: equal, not inf - inf = NaN
    finite = torch.isfinite(ref.logits)
    scale = torch.where(finite, ref.logits.abs(), 0.0).amax(-1).clamp(min=1.0)
    diff = torch.where(same, 0.0, (got.logits - ref.logits).abs()).nan_to_num(float("inf"))
    err = diff.amax(-1) / scale                                                            # (R,)
    if (err > tol).any():
        r = int(err.argmax())
        where = locate() if locate is not None else ""
        raise ScenarioFailure(f"{what}: request {r} logits differ from the unpadded eager run by {float(err[r]):.3g} "
                              f"(relative; tolerance {tol:g}; ran {got.mode}, bucket {got.num_tokens_padded}){where}")


def kv_bytes(runner: FullGraphRunner) -> list[torch.Tensor]:
    return [c.detach().view(torch.uint8).cpu().clone() for c in runner.kv_caches]


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ScenarioFailure(message)
