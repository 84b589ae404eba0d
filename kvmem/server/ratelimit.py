"""Per-tenant request rate (`[server] rate_limit_per_min`), cluster-wide where gateways share Redis.

A tenant may send `rate_limit_per_min` requests a minute on average and all of them at once
after a quiet minute (GCRA, the generic cell rate algorithm: one "theoretical arrival time" per
tenant, moved on by 60/rate seconds per request admitted; a request that would move it more than
a minute past now waits). Past that a request gets 429 `rate_limit_exceeded` with Retry-After.

With kv.shared_url set the state lives in that Redis, one key per tenant, updated by a Lua script
on Redis's own clock, so every gateway in front of the same Redis enforces one limit and their
clocks need not agree. Without it, in this process. A Redis that cannot be reached admits (the
limit protects the service; refusing everyone while Redis is away would be an outage of its own)
and says so in the log, once per outage.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import redis
from redis.exceptions import RedisError

from kvmem.kv.shared import CONNECT_TIMEOUT_S, safe_url
from kvmem.server.errors import ApiError

log = logging.getLogger(__name__)

PERIOD_S = 60.0
PREFIX = "kvmem:rate:"

# KEYS[1]: the tenant's key. ARGV: seconds per request, burst window in seconds. -> 0 admitted,
# else the seconds to wait (a string: Lua numbers reach Python as integers).
_GCRA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local step, window = tonumber(ARGV[1]), tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0')
if tat < now then tat = now end
local next_tat = tat + step
if next_tat - now > window then return tostring(next_tat - now - window) end
redis.call('SET', KEYS[1], tostring(next_tat), 'PX', math.ceil((next_tat - now) * 1000))
return '0'
"""


class RateLimiter:
    """admit(tenant) -> None when the request may go on, else the seconds until it may."""

    def __init__(self, per_min: int, redis_url: str | None = None) -> None:
        if per_min < 1:
            raise ValueError(f"rate_limit_per_min must be >= 1, got {per_min!r}")
        self.per_min = per_min
        self.step_s = PERIOD_S / per_min
        self._tat: dict[str, float] = {}  # in-process state (no Redis)
        self._lock = threading.Lock()
        self._client = None
        self._failing = False
        if redis_url:
            self._where = safe_url(redis_url)
            self._client = redis.Redis.from_url(redis_url, socket_timeout=CONNECT_TIMEOUT_S,
                                                socket_connect_timeout=CONNECT_TIMEOUT_S, client_name="kvmem-rate")
            self._script = self._client.register_script(_GCRA)

    @property
    def shared(self) -> bool:
        return self._client is not None

    def admit(self, tenant: str | None) -> float | None:
        name = tenant or ""
        wait = self._shared(name) if self._client is not None else self._local(name)
        return None if wait <= 0 else wait

    def _local(self, tenant: str) -> float:
        now = time.monotonic()
        with self._lock:
            next_tat = max(self._tat.get(tenant, now), now) + self.step_s
            if next_tat - now > PERIOD_S:
                return next_tat - now - PERIOD_S
            self._tat[tenant] = next_tat
            return 0.0

    def _shared(self, tenant: str) -> float:
        try:
            wait = float(self._script(keys=[PREFIX + tenant], args=[self.step_s, PERIOD_S]))
        except (RedisError, OSError) as e:
            if not self._failing:
                log.warning("rate limit store %s unreachable (%s): requests admitted unlimited until it is back",
                            self._where, e)
            self._failing = True
            return 0.0
        if self._failing:
            log.info("rate limit store %s reachable again: limits apply", self._where)
        self._failing = False
        return wait

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def enforce(limiter: RateLimiter | None, metrics, tenant: str | None) -> None:
    """ApiError 429 with Retry-After when `tenant` is past its rate (nothing without a limiter);
    counted in metrics.rejected. Blocking: one Redis round trip."""
    if limiter is None:
        return
    wait = limiter.admit(tenant)
    if wait is not None:
        metrics.rejected.labels("rate_limit").inc()
        raise ApiError(429, f"rate limit reached: {limiter.per_min} requests a minute per tenant; retry in "
                       f"{wait:.1f} s", type="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(max(1, math.ceil(wait)))})  # never 0: an instant retry fails
