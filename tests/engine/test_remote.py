"""Rendezvous routing of users to replicas: stable, balanced, and minimal movement when one goes."""

from collections import Counter

from kvmem.engine.remote import rendezvous

URLS = ["http://a:8000", "http://b:8000", "http://c:8000"]
USERS = [f"user-{i}" for i in range(3000)]


def test_a_user_always_gets_the_same_order():
    assert all(rendezvous(u, URLS) == rendezvous(u, list(reversed(URLS))) for u in USERS[:100])
    assert sorted(rendezvous("x", URLS)) == sorted(URLS)


def test_users_spread_evenly_over_replicas():
    first = Counter(rendezvous(u, URLS)[0] for u in USERS)
    assert set(first) == set(URLS) and all(900 < n < 1100 for n in first.values())


def test_losing_a_replica_moves_only_its_users_to_their_second_choice():
    before = {u: rendezvous(u, URLS) for u in USERS}
    after = {u: rendezvous(u, URLS[:2]) for u in USERS}
    for u in USERS:
        if before[u][0] != URLS[2]:
            assert after[u][0] == before[u][0]  # untouched
        else:
            assert after[u][0] == before[u][1]  # its failover replica is the one it now gets
