"""Fact records, their scopes, and the durable store that keeps them."""

from kvmem.facts.scope import Scope
from kvmem.facts.store import FactRecord, FactStore, HistoryEvent

__all__ = ["FactRecord", "FactStore", "HistoryEvent", "Scope"]
