"""Models that follow the protocol in ``fullgraph.models.base``."""
from .base import check_model
from .llama import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig", "check_model"]
