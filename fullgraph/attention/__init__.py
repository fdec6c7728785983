"""Attention: the layer models use, the per-step metadata, and the backends behind them."""
from .blocksparse import BlockSparseConfig
from .layer import Attention
from .metadata import AttentionMetadata
from . import backends

__all__ = ["Attention", "BlockSparseConfig", "AttentionMetadata", "backends"]
