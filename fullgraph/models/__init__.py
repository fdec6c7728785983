"""Models that follow the protocol in ``fullgraph.models.base``."""
from .base import check_model
from .llama import Llama, LlamaConfig
from .phi3_small import Phi3Small, Phi3SmallConfig

__all__ = ["Llama", "LlamaConfig", "Phi3Small", "Phi3SmallConfig", "check_model"]
