"""Models that follow the protocol in ``fullgraph.models.base``, the architectures a checkpoint
may name (``from_pretrained``, ``from_hf``), and the presets of their shapes."""
from . import presets
from .base import CausalLM, DecoderLM, check_model
from .llama import Llama, LlamaConfig
from .phi3_small import Phi3Small, Phi3SmallConfig
from .registry import ARCHITECTURES, from_hf, from_pretrained, supported_architectures

__all__ = ["ARCHITECTURES", "CausalLM", "DecoderLM", "Llama", "LlamaConfig", "Phi3Small", "Phi3SmallConfig",
           "check_model", "from_hf", "from_pretrained", "presets", "supported_architectures"]
