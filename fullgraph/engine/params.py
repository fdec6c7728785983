"""SamplingParams (vLLM's names and defaults) and the outputs a request produces."""
from __future__ import annotations

import enum
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    """What ``Engine.step`` returns for a request (vLLM's names): ``CUMULATIVE``, an output every
    step with the whole text and token ids so far; ``DELTA``, an output every step with only what
    the step added (``text`` / ``token_ids`` / ``logprobs`` equal the ``delta_`` fields); ``FINAL_ONLY``,
    one output, cumulative, when the request finishes (``LLM.generate`` asks for this: no
    per-token copies of a growing output)."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


def _number(value, name: str, kind=numbers.Real):
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"SamplingParams.{name}: expected {'an int' if kind is numbers.Integral else 'a number'}, "
                         f"got {type(value).__name__} {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request (validated at construction; a bad field is a ``ValueError`` naming it).

    ``temperature`` 0 is greedy. Filters apply in this order: logits / temperature -> ``top_k``
    (-1: off) -> ``top_p`` on the resulting softmax (1: off) -> ``min_p`` relative to the top
    probability (0: off). ``seed``: the request's own counter-based stream (the same tokens whatever
    else is in the batch); None: drawn from the engine's generator. ``max_tokens`` None: up to the
    runner's ``max_model_len``. ``stop``: strings that end generation (matched on bytes across
    tokens, not included in the text unless ``include_stop_str_in_output``); ``stop_token_ids`` and,
    unless ``ignore_eos``, the checkpoint's eos ids end it too. ``logprobs``: return the sampled
    token's logprob and the top ``logprobs`` of each step (needs ``LLM(max_logprobs=...)`` at least that).
    ``structured``: constrain the output (``fullgraph.Structured``; needs ``LLM(structured=True)``).
    ``output_kind``: a ``RequestOutputKind`` or its value (``"cumulative"``, ``"delta"``, ``"final_only"``).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: object = None   # a fullgraph.Structured: JSON schema / regex / grammar / choice
    output_kind: RequestOutputKind | str = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if _number(self.n, "n", numbers.Integral) != 1:
            raise ValueError(f"SamplingParams.n: only n=1 is supported, got {self.n}")
        if _number(self.temperature, "temperature") < 0:
            raise ValueError(f"SamplingParams.temperature: must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < _number(self.top_p, "top_p") <= 1:
            raise ValueError(f"SamplingParams.top_p: must be in (0, 1], got {self.top_p}")
        if _number(self.top_k, "top_k", numbers.Integral) < -1 or self.top_k == 0:
            raise ValueError(f"SamplingParams.top_k: must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= _number(self.min_p, "min_p") < 1:
            raise ValueError(f"SamplingParams.min_p: must be in [0, 1), got {self.min_p}")
        if self.seed is not None and not 0 <= _number(self.seed, "seed", numbers.Integral) < 2**63:
            raise ValueError(f"SamplingParams.seed: must be an int in [0, 2**63), got {self.seed}")
        if self.max_tokens is not None and _number(self.max_tokens, "max_tokens", numbers.Integral) < 1:
            raise ValueError(f"SamplingParams.max_tokens: must be >= 1 (or None), got {self.max_tokens}")
        if self.logprobs is not None and _number(self.logprobs, "logprobs", numbers.Integral) < 0:
            raise ValueError(f"SamplingParams.logprobs: must be >= 0 (or None), got {self.logprobs}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"SamplingParams.stop: expected non-empty strings, got {self.stop!r}")
        ids = list(self.stop_token_ids or [])
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0:
                raise ValueError(f"SamplingParams.stop_token_ids: expected ids >= 0, got {i!r}")
        if self.structured is not None and type(self.structured).__name__ != "Structured":
            raise ValueError(f"SamplingParams.structured: expected a fullgraph.Structured, got "
                             f"{type(self.structured).__name__}")
        try:
            kind = RequestOutputKind(self.output_kind.value if isinstance(self.output_kind, RequestOutputKind)
                                     else self.output_kind)
        except (ValueError, TypeError):
            raise ValueError(f"SamplingParams.output_kind: expected a RequestOutputKind or one of "
                             f"{[k.value for k in RequestOutputKind]}, got {self.output_kind!r}") from None
        object.__setattr__(self, "output_kind", kind)
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class CompletionOutput:
    """One generated sequence: cumulative ``text`` and ``token_ids``, and what this step added."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None     # "stop" | "length" | "abort" | None (running)
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[dict[int, float]] | None = None   # per token: id -> logprob (the sample's and the top ones)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0          # prompt tokens whose KV came from the prefix cache (not computed)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]       # one list per request, shared by its outputs (not the engine's own)
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0          # vLLM's name: prompt tokens served from the prefix cache
