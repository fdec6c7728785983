"""Requests in, text out: ``LLM``, ``Engine`` (continuous batching over a sampling runner),
``SamplingParams`` and the outputs. See ``engine.engine`` for the loop and ``scheduler`` for the
batching policy."""
from .engine import Engine
from .llm import LLM, load_tokenizer
from .params import CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind, SamplingParams
from .structured import Structured

__all__ = ["CompletionOutput", "Engine", "LLM", "RequestMetrics", "RequestOutput", "RequestOutputKind", "SamplingParams", "Structured", "load_tokenizer"]
