"""Fidelity points by name (kv/fidelity.py): the named ones and the specs bench ttft --points takes."""

import pytest

from kvmem.kv.fidelity import POINTS, Fidelity, parse
from kvmem.kv.recompute import Recompute


def test_a_point_is_named_or_spelled_out():
    assert parse("exact") == POINTS["exact"]
    assert parse("text-facts-2") == Fidelity(Recompute(0.0), 2)
    assert parse("first-0.15") == Fidelity(Recompute(0.15, "first"))
    assert parse("progressive-0.3") == Fidelity(Recompute(0.3, "progressive"))


@pytest.mark.parametrize("bad", ["turbo", "text-facts-", "text-facts-x", "first-1.5", "oracle-0.1", "first-", "0.15"])
def test_anything_else_is_refused_with_the_choices(bad):
    with pytest.raises(ValueError, match="fidelity point is one of"):
        parse(bad)
