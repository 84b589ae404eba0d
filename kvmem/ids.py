"""Fact ids as every room checks them: the fact store (a row's key) and the KV store (a file name).

Bottom-level on purpose: both rooms import it, neither imports the other for it. It may import
only `kvmem.errors`.
"""

from __future__ import annotations

import re

from kvmem.errors import InvalidInputError

# A file name on every filesystem kvmem runs on, and no path: no '/', no NUL, nothing to quote.
FACT_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def check_fact_id(fact_id: str) -> str:
    """`fact_id` if it may name a fact, else InvalidInputError (param "fact_id").

    A leading '.' is refused too: such a blob file would be hidden, and '.' or '..' is a folder."""
    if not isinstance(fact_id, str) or not FACT_ID_PATTERN.match(fact_id) or fact_id.startswith("."):
        raise InvalidInputError(f"fact id {fact_id!r} must be 1-128 of [A-Za-z0-9_.:-], not starting with '.'",
                                param="fact_id")
    return fact_id
