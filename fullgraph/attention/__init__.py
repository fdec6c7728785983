"""Attention: the layer models use, the backend interface, the reference path and the backends."""
from .blocksparse import BlockSparseConfig
from .interface import AttentionBackend, AttentionMetadata, BackendLimits, Rotary
from .layer import Attention
from . import backends

__all__ = ["Attention", "AttentionBackend", "AttentionMetadata", "BackendLimits", "BlockSparseConfig", "Rotary",
           "backends"]
