"""What a scope remembers between searches: the rows passing its recent filters.

Testing a filter runs a Python predicate per row (about 1 us each: 10 ms at 10k rows, 0.1 s at
100k), while a service's filters repeat (a category, an agent, a date range); so a scope keeps
the answer for its last few filters until its next write makes them stale.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from kvmem.index.filters import Filters

FILTERS_REMEMBERED = 8  # per scope: the passing rows of this many recent filters


class RememberedFilters:
    """Passing rows per filter, valid until `invalidate`. Writers call `invalidate` under the
    scope's write lock; searches, which share its read lock, may call `passing` concurrently."""

    def __init__(self) -> None:
        self.version = 0  # bumped by every write: answers remembered under an older one are stale
        self._answers: OrderedDict[Filters, tuple[int, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._answers)

    def invalidate(self) -> None:
        self.version += 1

    def passing(self, conditions: Filters, compute: Callable[[], np.ndarray]) -> np.ndarray:
        """The rows passing `conditions`: remembered, or `compute()`d and remembered."""
        with self._lock:
            hit = self._answers.get(conditions)
            if hit is not None and hit[0] == self.version:
                self._answers.move_to_end(conditions)
                return hit[1]
        version, rows = self.version, compute()
        with self._lock:
            self._answers[conditions] = (version, rows)
            self._answers.move_to_end(conditions)
            while len(self._answers) > FILTERS_REMEMBERED:
                self._answers.popitem(last=False)
        return rows

