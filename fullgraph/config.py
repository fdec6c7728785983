"""RunnerConfig: the limits a runner is built for, validated once, frozen afterwards."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from . import env

CUDAGRAPH_MODES = ("none", "padded", "full")


def default_capture_sizes(max_size: int, max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to 256, every 16 up to 512, every 128 up to ``max_size``.

    ``max_size`` itself and ``max_num_seqs`` (when it fits) are always included, so an off-stride
    maximum never silently misses its graph. Above 512 tokens a step is mostly prefill and each
    graph adds capture time: 12 graphs take a runner from 512 to 2,048 tokens. The padding costs
    at most 127 tokens: a 513-token step runs as 640 (on the H200, llama-1b: 3.4 ms at 512, 4.2
    at 768 in a graph; 13.4 ms for 512 eagerly, what a step above the largest graph pays).
    """
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 513, 16)) + list(range(640, max_size + 1, 128))
    sizes = {s for s in sizes if s <= max_size}
    sizes.add(max_size)
    if max_num_seqs <= max_size:
        sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


@dataclass(frozen=True)
class RunnerConfig:
    """Static limits of a runner. Every static buffer and captured graph is sized from these.

    Attributes:
        max_num_seqs: most requests (chunks) in one step.
        max_num_tokens: most tokens in one step (prefill chunks + decode tokens).
        max_model_len: longest sequence (context + new tokens) any request may reach.
        block_size: tokens per KV-cache page (a power of two).
        num_blocks: KV-cache pages per layer, the null block 0 included. ``None`` picks enough for
            ``max_num_seqs`` requests at ``max_model_len`` (resolved by the runner).
        cudagraph: "none" (eager, unpadded), "padded" (eager on the padded static buffers),
            "full" (CUDA graphs), or "auto" (full on CUDA, padded elsewhere).
        attention: the dense attention backend: a registered name ("sdpa", "triton", "flash",
            or "auto": the fastest that serves every step here), or an ``AttentionBackend``
            subclass (registered or not); or a dict layer kind -> backend, e.g.
            ``{"dense": "sdpa", "blocksparse": MyBackend}``.
        capture_sizes: token-count buckets to pad to and capture; ``None`` -> the default schedule
            up to ``max_capture_size``. ``max_num_seqs`` is added when it fits, so every decode
            batch has a bucket; steps above the largest size run padded-eager.
        max_capture_size: largest default bucket (``None`` -> ``max_num_tokens``).
        validate: check every invariant of each padded plan (and, in graph mode, input addresses
            and NaN poisoning) before running it. Slow; for tests and debugging.
        compile: run the model step through ``torch.compile(fullgraph=True)``.
        sampling: the step samples one token per request inside the graph (per-request parameters
            are step fields, ``fields.SAMPLING_FIELDS``) and returns token ids instead of logits.
        max_logprobs: with ``sampling``, the graph also returns each sampled token's logprob and
            the top ``max_logprobs`` logprobs of every request (0: none).
        structured: with ``sampling``, requests may be constrained by an allowed-token bitmask
            (step fields ``constrained`` and ``token_bitmask``), applied in the graph before the
            sampling filters.
    """

    max_num_seqs: int = 16
    max_num_tokens: int = 512
    max_model_len: int = 2048
    block_size: int = 16
    num_blocks: int | None = None
    cudagraph: str = "auto"
    attention: Any = "auto"  # str | type[AttentionBackend] | dict[str, str | type[AttentionBackend]]
    capture_sizes: tuple[int, ...] | None = None
    max_capture_size: int | None = None
    validate: bool = False
    compile: bool = False
    sampling: bool = False
    max_logprobs: int = 0
    structured: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_tokens", "max_model_len", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RunnerConfig.{name} must be a positive int, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"RunnerConfig.block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs > self.max_num_tokens:
            raise ValueError(
                f"RunnerConfig.max_num_seqs ({self.max_num_seqs}) exceeds max_num_tokens "
                f"({self.max_num_tokens}): every request brings at least one token; lower "
                "max_num_seqs or raise max_num_tokens")
        if self.max_num_tokens > self.max_num_seqs * self.max_model_len:
            raise ValueError(
                f"RunnerConfig.max_num_tokens ({self.max_num_tokens}) exceeds max_num_seqs * max_model_len "
                f"({self.max_num_seqs} * {self.max_model_len}): no step can hold that many tokens")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0 or (self.max_logprobs and not self.sampling):
            raise ValueError(f"RunnerConfig.max_logprobs must be an int >= 0, and needs sampling=True "
                             f"(got {self.max_logprobs!r}, sampling={self.sampling})")
        if self.structured and not self.sampling:
            raise ValueError("RunnerConfig.structured needs sampling=True (the mask applies where the graph samples)")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(
                f"RunnerConfig.num_blocks must be >= 2 (block 0 is the reserved null block), "
                f"got {self.num_blocks}")
        if self.cudagraph not in CUDAGRAPH_MODES + ("auto",):
            raise ValueError(
                f"RunnerConfig.cudagraph must be one of {CUDAGRAPH_MODES + ('auto',)}, "
                f"got {self.cudagraph!r}")
        if self.max_capture_size is not None and not 1 <= self.max_capture_size <= self.max_num_tokens:
            raise ValueError(
                f"RunnerConfig.max_capture_size must be in [1, max_num_tokens={self.max_num_tokens}], "
                f"got {self.max_capture_size}")
        if self.capture_sizes is not None:
            sizes = tuple(self.capture_sizes)
            bad = [s for s in sizes if not isinstance(s, int) or not 1 <= s <= self.max_num_tokens]
            if not sizes or bad:
                raise ValueError(
                    f"RunnerConfig.capture_sizes must be non-empty ints in [1, max_num_tokens="
                    f"{self.max_num_tokens}], got {sizes!r}")
            object.__setattr__(self, "capture_sizes", tuple(sorted(set(sizes))))

    @functools.cached_property
    def max_blocks_per_seq(self) -> int:
        """Columns of ``block_table``: pages needed by a request at ``max_model_len``."""
        return -(-self.max_model_len // self.block_size)

    @functools.cached_property
    def buckets(self) -> tuple[int, ...]:
        """Token-count buckets, ascending (see ``capture_sizes``)."""
        if self.capture_sizes is None:
            return default_capture_sizes(self.max_capture_size or self.max_num_tokens, self.max_num_seqs)
        sizes = set(self.capture_sizes)
        if self.max_num_seqs <= max(sizes):
            sizes.add(self.max_num_seqs)
        return tuple(sorted(sizes))

    def padded_num_reqs(self, num_tokens_padded: int) -> int:
        """Requests a step padded to ``num_tokens_padded`` tokens is laid out for: the bucket
        itself, capped at ``max_num_seqs`` (every request brings a token, so no step of that bucket
        has more). The one place this rule lives: planner, capture and runner all ask here."""
        return min(num_tokens_padded, self.max_num_seqs)

    def replace(self, **changes) -> RunnerConfig:
        return dataclasses.replace(self, **changes)


def resolve_mode(config: RunnerConfig, cuda_available: bool) -> RunnerConfig:
    """Apply the environment overrides (``fullgraph.env``, read here, once) and resolve "auto"."""
    changes: dict = {}
    env_mode = env.cudagraph_override()
    if env_mode:
        if env_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"{env.CUDAGRAPH}={env_mode!r}: expected one of {CUDAGRAPH_MODES}")
        changes["cudagraph"] = env_mode
    env_compile = env.compile_override()
    if env_compile:
        if env_compile not in ("0", "1"):
            raise ValueError(f"{env.COMPILE}={env_compile!r}: expected 0 or 1")
        changes["compile"] = env_compile == "1"
    mode = changes.get("cudagraph", config.cudagraph)
    if mode == "auto":
        changes["cudagraph"] = "full" if cuda_available else "padded"
    elif mode == "full" and not cuda_available:
        source = f"{env.CUDAGRAPH}=full in the environment" if env_mode else 'cudagraph="full"'
        raise ValueError(
            f"{source} needs a CUDA device, and the model is not on one (there is nothing to capture on "
            'a CPU); use "padded" to run the same padded static buffers eagerly, or "none" for plain eager')
    return config.replace(**changes) if changes else config
