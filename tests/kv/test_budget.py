"""The disk budget's accounting and eviction order (LFU with dynamic aging), without files."""

import pytest

from kvmem.errors import InvalidInputError
from kvmem.kv.budget import DiskBudget


def test_nothing_is_evicted_within_the_budget_and_unlimited_never_evicts():
    budget = DiskBudget(300)
    assert [budget.admit(f, "u", 100) for f in "abc"] == [[], [], []]
    assert budget.used == 300 and len(budget) == 3
    unlimited = DiskBudget()
    assert all(unlimited.admit(str(i), "u", 10**9) == [] for i in range(100))


def test_past_the_budget_the_least_used_blob_goes():
    budget = DiskBudget(300)
    for f in "abc":
        budget.admit(f, "u", 100)
    budget.touch(["a", "a", "c"])
    assert budget.admit("d", "u", 100) == ["b"]  # b was never used
    assert budget.used == 300 and not budget.holds("b") and budget.evictions == 1


def test_a_cold_newcomer_is_its_own_victim_when_every_blob_is_hotter():
    budget = DiskBudget(200)
    budget.admit("a", "u", 100)
    budget.admit("b", "u", 100)
    budget.touch(["a", "b"] * 3)
    assert budget.admit("c", "u", 100) == ["c"]
    assert budget.holds("a") and budget.holds("b")


def test_aging_lets_new_facts_overtake_facts_that_were_hot_long_ago():
    budget = DiskBudget(200)
    budget.admit("old", "u", 100)
    budget.touch(["old"] * 3)
    budget.admit("x", "u", 100)
    # A stream of newcomers, each used a few times, raises the age until "old" is the lowest.
    evicted = []
    for i in range(10):
        budget.touch([f"n{i}"] * 4)  # used (as text) before its blob exists
        evicted += budget.admit(f"n{i}", "u", 100)
    assert "old" in evicted


def test_a_tenant_past_its_quota_loses_its_own_blobs_only():
    budget = DiskBudget(quota_bytes=200)
    budget.admit("bob-1", "bob", 100)
    budget.touch(["bob-1"])  # bob's blob is cold next to alice's? it must not matter
    for f in ("a1", "a2"):
        budget.admit(f, "alice", 100)
    assert budget.admit("a3", "alice", 100) == ["a1"]
    assert budget.holds("bob-1") and budget.tenant_bytes("alice") == 200 and budget.tenant_bytes("bob") == 100


def test_readmission_only_when_the_fact_would_displace_a_less_used_blob():
    budget = DiskBudget(200)
    for f in "abc":
        budget.admit(f, "u", 100)  # "a" evicted: all tie, the oldest entry goes first
    assert not budget.holds("a")
    assert not budget.worth_readmitting("a", "u")  # no more used than b or c
    budget.touch(["a", "a"])
    assert budget.worth_readmitting("a", "u")
    assert budget.admit("a", "u", 100) == ["b"]


def test_a_blob_larger_than_the_budget_is_never_worth_readmitting():
    budget = DiskBudget(100)
    assert budget.admit("big", "u", 150) == ["big"]
    budget.touch(["big"] * 10)
    assert not budget.worth_readmitting("big", "u")


def test_forget_returns_the_bytes_and_the_history():
    budget = DiskBudget(200, quota_bytes=200)
    budget.admit("a", "u", 100)
    budget.touch(["a"] * 5)
    budget.forget("a")
    assert budget.used == 0 and budget.tenant_bytes("u") == 0 and len(budget) == 0
    budget.admit("a", "u", 100)
    budget.admit("b", "u", 100)
    assert budget.admit("c", "u", 100) == ["a"]  # its old hits were forgotten with it


def test_negative_budgets_are_refused():
    with pytest.raises(InvalidInputError) as err:
        DiskBudget(-1)
    assert err.value.param == "budget_bytes"
    with pytest.raises(InvalidInputError) as err:
        DiskBudget(quota_bytes=-5)
    assert err.value.param == "quota_bytes"


def test_a_quota_of_zero_evicts_every_blob_of_the_tenant():
    budget = DiskBudget(quota_bytes=0)
    assert budget.admit("a", "u", 100) == ["a"]
    assert budget.admit("b", "u", 100) == ["b"]  # the tenant had no bytes left to count
    assert budget.tenant_bytes("u") == 0 and len(budget) == 0


def test_saved_counts_rank_the_blobs_after_a_restart():
    before = DiskBudget()
    for f in "abc":
        before.admit(f, "u", 100)
    before.touch(["a", "c", "c"])
    saved = before.changed_hits()
    assert saved == {"a": 1, "c": 2} and before.changed_hits() == {}  # each change handed out once
    after = DiskBudget(200)
    after.remember(saved)
    victims = [v for f in "abc" for v in after.admit(f, "u", 100)]
    assert victims == ["b"]  # the least used, not the first counted


def test_the_eviction_order_stays_bounded_however_often_blobs_are_used():
    """Each use re-files a blob; the old filings of hot blobs never reach the top of the order,
    so without compaction they piled up for as long as the service ran."""
    budget = DiskBudget(1_000)
    for f in range(10):
        budget.admit(str(f), "u", 100)
    for _ in range(5_000):
        budget.touch(["0", "1"])
    assert len(budget._all.items) <= 2 * len(budget) + 1024
    budget.touch(["2"] * 3)
    assert budget.admit("new", "u", 100) == ["3"]  # the order survived the rebuilds
    unlimited = DiskBudget()
    unlimited.admit("a", "u", 100)
    unlimited.touch(["a"] * 5_000)
    assert unlimited._all.items == []  # nothing to order when nothing is ever evicted


def test_hits_count_live_uses_on_top_of_the_saved_ones():
    budget = DiskBudget()
    budget.remember({"a": 2})
    budget.touch(["a", "b", "a"])
    assert [budget.hits(f) for f in "abc"] == [4, 1, 0]
    budget.forget("a")
    assert budget.hits("a") == 0
