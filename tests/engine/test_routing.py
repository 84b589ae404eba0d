"""The routing policies (kvmem/engine/routing.py): residency scoring against brute-force oracles,
rendezvous on ties, and the residency index's tiers, speculative entries and drops."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem.engine.remote import rendezvous
from kvmem.engine.routing import (DISK, MIB, RAM, Load, Resident, ResidencyIndex, Weights, expected_delay,
                                  residency_order)
from kvmem.errors import InvalidInputError

W = Weights(pull_s_per_mib=0.015, disk_s_per_mib=0.0003, queue_s=0.2)
URLS = [f"http://r{i}:8000" for i in range(8)]


def test_cold_and_idle_is_rendezvous():
    for user in ("alice", "bob", "u17"):
        ranked = rendezvous(user, URLS)
        assert residency_order(ranked, 50 * MIB, {}, {}, W) == ranked


def test_resident_replica_wins_until_its_queue_costs_more_than_the_pulls():
    ranked = rendezvous("alice", URLS)
    warm = ranked[3]
    resident = {warm: Resident(ram=10 * MIB)}
    assert residency_order(ranked, 10 * MIB, resident, {}, W)[0] == warm
    # 10 MiB missing elsewhere cost 0.15 s; each chat waiting beyond the slots 0.2 s.
    assert residency_order(ranked, 10 * MIB, resident, {warm: Load(queued=4, slots=4)}, W)[0] == ranked[0]
    assert residency_order(ranked, 10 * MIB, resident, {warm: Load(queued=3, slots=4)}, W)[0] == warm


def test_disk_tier_counts_less_than_ram():
    ranked = rendezvous("bob", URLS)
    a, b = ranked[5], ranked[6]
    order = residency_order(ranked, 4 * MIB, {a: Resident(disk=4 * MIB), b: Resident(ram=4 * MIB)}, {}, W)
    assert order[:2] == [b, a]


@pytest.mark.parametrize("field", ["pull_s_per_mib", "disk_s_per_mib", "queue_s"])
def test_negative_weight_is_refused_with_its_param(field):
    kwargs = {"pull_s_per_mib": 1.0, "disk_s_per_mib": 1.0, "queue_s": 1.0, field: -0.1}
    with pytest.raises(InvalidInputError) as e:
        Weights(**kwargs)
    assert e.value.param == field and e.value.code == InvalidInputError.INVALID_VALUE


replica_state = st.tuples(st.integers(0, 60), st.integers(0, 60), st.integers(0, 9), st.integers(1, 4))


@settings(max_examples=300, deadline=None)
@given(user=st.text(min_size=1, max_size=8), states=st.lists(st.none() | replica_state, min_size=1, max_size=8),
       request_mib=st.integers(1, 60))
def test_order_matches_brute_force(user, states, request_mib):
    """Oracle: every replica's delay written out in plain arithmetic, then the order every pair
    must keep: lower delay first, equal delays in rendezvous order."""
    urls = URLS[: len(states)]
    ranked = rendezvous(user, urls)
    resident, load, delay = {}, {}, {}
    for url, state in zip(urls, states):
        ram = disk = queued = 0
        slots = 1
        if state is not None:
            ram, disk, queued, slots = state
            disk = min(disk, max(0, request_mib - ram))  # a replica holds at most the request's facts
            ram = min(ram, request_mib)
            resident[url] = Resident(ram=ram * MIB, disk=disk * MIB)
            load[url] = Load(queued=queued, slots=slots)
        delay[url] = ((request_mib - ram - disk) * W.pull_s_per_mib + disk * W.disk_s_per_mib
                      + max(0, queued - slots + 1) * W.queue_s)
    order = residency_order(ranked, request_mib * MIB, resident, load, W)
    assert sorted(order) == sorted(urls)
    for i, a in enumerate(order):
        for b in order[i + 1:]:
            assert delay[a] <= delay[b] + 1e-12
            if abs(delay[a] - delay[b]) < 1e-12:
                assert ranked.index(a) < ranked.index(b)


def test_expected_delay_never_negative_when_more_is_resident_than_asked():
    assert expected_delay(MIB, Resident(ram=2 * MIB), Load(), W) == 0.0


# ResidencyIndex against a replay of its event log.

events = st.lists(st.tuples(
    st.sampled_from(["stored", "removed", "removed_all", "speculate", "drop", "advance"]),
    st.sampled_from(["r0", "r1", "r2"]), st.sampled_from(["f0", "f1", "f2", "f3"]),
    st.sampled_from([RAM, DISK])), max_size=40)


def replay(log, sizes, now, ttl):
    """Brute force: walk the whole log for each (replica, fact) and decide its tier at `now`."""
    out = {}
    for replica in ("r0", "r1", "r2"):
        ram = disk = 0
        for fact, nbytes in sizes.items():
            tiers, guess_until = set(), None
            for kind, r, f, tier, at in log:
                if kind == "drop" and r == replica:
                    tiers, guess_until = set(), None
                if r != replica or f != fact:
                    continue
                if kind == "stored":
                    tiers.add(tier)
                elif kind == "removed":
                    tiers.discard(tier)
                elif kind == "removed_all":
                    tiers.clear()
                elif kind == "speculate":
                    guess_until = at + ttl
            if RAM in tiers or (guess_until is not None and guess_until > now):
                ram += nbytes
            elif DISK in tiers:
                disk += nbytes
        if ram or disk:
            out[replica] = Resident(ram, disk)
    return out


@settings(max_examples=300, deadline=None)
@given(log=events, query=st.sets(st.sampled_from(["f0", "f1", "f2", "f3"]), min_size=1))
def test_index_matches_replay_of_its_events(log, query):
    ttl, now = 2.0, 0.0
    index = ResidencyIndex(speculative_ttl_s=ttl)
    sizes = {f: 100 + i for i, f in enumerate(sorted(query))}
    done = []
    for kind, replica, fact, tier in log:
        if kind == "advance":
            now += 0.75
            continue
        if kind == "stored":
            index.stored(replica, fact, tier)
        elif kind == "removed":
            index.removed(replica, fact, tier)
        elif kind == "removed_all":
            index.removed(replica, fact)
        elif kind == "speculate":
            index.speculate(replica, [fact], now)
        elif kind == "drop":
            index.drop(replica)
        done.append((kind, replica, fact, tier, now))
        # Asked between events too: a lookup prunes expired guesses, which must change nothing.
        assert index.resident(sizes, now) == replay(done, sizes, now, ttl)


def test_drop_forgets_what_a_replica_reported_and_was_assumed_to_hold():
    """Regression: drop() once raised KeyError on a replica that had reported a blob."""
    index = ResidencyIndex()
    index.stored("r0", "f0", RAM)
    index.stored("r0", "f0", DISK)
    index.stored("r1", "f0", DISK)
    index.speculate("r0", ["f1"], now=0.0)
    index.drop("r0")
    assert index.resident({"f0": 10, "f1": 10}, now=0.0) == {"r1": Resident(disk=10)}
    index.drop("r0")  # twice is harmless


def test_speculative_entry_counts_as_ram_until_its_ttl():
    index = ResidencyIndex(speculative_ttl_s=2.0)
    index.stored("r1", "f0", DISK)
    index.speculate("r1", ["f0", "f1"], now=10.0)
    assert index.resident({"f0": 5, "f1": 7}, now=11.9) == {"r1": Resident(ram=12)}
    assert index.resident({"f0": 5, "f1": 7}, now=12.0) == {"r1": Resident(disk=5)}


def test_unknown_tier_is_refused():
    with pytest.raises(InvalidInputError) as e:
        ResidencyIndex().stored("r0", "f0", "gpu")
    assert e.value.param == "tier"
