"""Sentence embedders that turn fact and query text into vectors for the index."""

from kvmem.embed.base import Embedder, l2_normalize
from kvmem.embed.minilm import MiniLMEmbedder, default_embedder

__all__ = ["Embedder", "MiniLMEmbedder", "default_embedder", "l2_normalize"]
