"""Vector search over facts, per scope (user), with Mem0-style metadata filters."""

from kvmem.index.base import Hit, VectorIndex
from kvmem.index.exact import ExactIndex
from kvmem.index.filters import OPERATORS, Condition, Filters, matcher, matches, validate_filters
from kvmem.index.predicates import Logic

__all__ = [
    "OPERATORS",
    "Condition",
    "ExactIndex",
    "Filters",
    "Hit",
    "Logic",
    "VectorIndex",
    "matcher",
    "matches",
    "validate_filters",
]
