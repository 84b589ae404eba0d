"""Fact records and where they are kept."""

from kvmem.facts.registry import Fact, FactRegistry

__all__ = ["Fact", "FactRegistry"]
