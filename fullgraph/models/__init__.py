"""Models that follow the protocol in ``fullgraph.models.base``, and the presets of their shapes."""
from . import presets
from .base import CausalLM, DecoderLM, check_model
from .llama import Llama, LlamaConfig
from .phi3_small import Phi3Small, Phi3SmallConfig

__all__ = ["CausalLM", "DecoderLM", "Llama", "LlamaConfig", "Phi3Small", "Phi3SmallConfig", "check_model", "presets"]
