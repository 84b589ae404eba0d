"""Which facts' KV a replica holds in RAM, as a summary in the shared Redis tier (issue 54).

Each replica's connector writes one hash, `kvmem:resident:<fingerprint[:16]>:<replica URL>`,
fact id -> blob bytes, for the blobs its RAM tier holds (connector/residency.py), and rewrites it
whole when that set changes. The hash expires unless rewritten (`TTL_S`), so a replica that dies
stops attracting requests on its own. Gateways read the hashes of their live replicas for a
request's facts in one pipelined round trip (engine/residency.py) and route by them
(engine/routing.py). The keys are per (fact, model fingerprint), not prefix hashes: a fact's KV is
placed mid-prompt, where a prefix index would stop at the first miss.

Only the RAM tier is summarised: it is what a replica's own reads decide (a pull from Redis costs
~1.7 ms per 0.46 MB blob here, a local disk read ~0.13 ms, RAM ~0.01 ms: docs/results/tier-costs.json),
and listing a disk folder on every change would cost more than it tells.
"""

from __future__ import annotations

from collections.abc import Mapping

import redis

PREFIX = "kvmem:resident:"
TTL_S = 30  # a summary not rewritten for this long is gone (its replica died or left)


def key(fingerprint: str, replica: str) -> str:
    """The summary of `replica` (its URL as gateways route to it) for one model's KV."""
    return f"{PREFIX}{fingerprint[:16]}:{replica.rstrip('/')}"


def publish(client: redis.Redis, fingerprint: str, replica: str, resident: Mapping[str, int]) -> None:
    """Replace the replica's summary with `resident` (fact id -> bytes), atomically."""
    name = key(fingerprint, replica)
    pipe = client.pipeline(transaction=True)
    pipe.delete(name)
    if resident:
        pipe.hset(name, mapping=dict(resident))
        pipe.expire(name, TTL_S)
    pipe.execute()


def read(client: redis.Redis, fingerprint: str, replicas: list[str], facts: list[str]) -> dict[str, dict[str, int]]:
    """replica -> {fact id: bytes} for those of `facts` each replica's summary holds."""
    if not replicas or not facts:
        return {}
    pipe = client.pipeline(transaction=False)
    for replica in replicas:
        pipe.hmget(key(fingerprint, replica), facts)
    found = {}
    for replica, sizes in zip(replicas, pipe.execute()):
        held = {fact: int(size) for fact, size in zip(facts, sizes) if size is not None}
        if held:
            found[replica] = held
    return found
