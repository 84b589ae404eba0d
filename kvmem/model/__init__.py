"""Which model kvmem serves: the bundled default, a local HF folder, or a hub id."""

from kvmem.model.resolve import ModelInfo, resolve_model

__all__ = ["ModelInfo", "resolve_model"]
