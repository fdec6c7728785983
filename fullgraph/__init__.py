"""fullgraph: run a decoder-only transformer step as one captured CUDA graph.

Public API::

    import fullgraph as fg
    runner = fg.FullGraphRunner(fg.models.Llama(fg.models.LlamaConfig.toy()))
    out = runner.step([fg.SeqChunk(token_ids=[5, 9, 2], start_pos=0, block_ids=runner.blocks.allocate(1))])
"""
from . import attention, models, padding
from .config import RunnerConfig
from .graphs import CaptureReport
from .padding import PaddingPolicy
from .plan import SeqChunk, StepPlan, plan_step
from .runner import FullGraphRunner, StepOutput
from . import debug, parallel, testing  # noqa: E402  (need the runner)
from .engine import (LLM, CompletionOutput, Engine, RequestOutput, RequestOutputKind, SamplingParams,  # noqa: E402
                     Structured)

__all__ = ["FullGraphRunner", "RunnerConfig", "SeqChunk", "StepPlan", "StepOutput", "CaptureReport",
           "PaddingPolicy", "plan_step", "padding", "models", "attention", "debug", "parallel", "testing",
           "LLM", "Engine", "SamplingParams", "Structured", "RequestOutput", "RequestOutputKind",
           "CompletionOutput"]
__version__ = "0.1.0"
