"""Per-tenant request rates (server/ratelimit.py): one limit across two gateways sharing a real
Redis, the same rule in one process without Redis, and a Redis that is away admitting."""

from __future__ import annotations

import uuid

import pytest
from fastapi.testclient import TestClient

from kvmem.config import Config, KVConfig
from kvmem.server.app import create_app
from kvmem.server.ratelimit import RateLimiter
from kvmem.server.settings import ServerSettings, SettingsError
from kvmem.service import KVMem
from tests.server.conftest import assert_error

KEYS = {"sk-a": "alpha", "sk-b": "beta"}


def _tenants() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:6]  # tenants of their own: the session's Redis outlives one test
    return f"alpha-{tag}", f"beta-{tag}"


@pytest.mark.parametrize("shared", [True, False], ids=["redis", "in-process"])
def test_a_tenant_gets_its_rate_and_no_more_another_tenant_is_untouched(redis_url, shared):
    alpha, beta = _tenants()
    limiters = [RateLimiter(6, redis_url if shared else None) for _ in range(2)]
    if not shared:
        limiters = limiters[:1] * 2  # in-process: one process's limiter, asked twice as often
    admitted = [limiters[i % 2].admit(alpha) is None for i in range(8)]
    assert admitted == [True] * 6 + [False] * 2  # a minute's worth at once, across both gateways
    wait = limiters[0].admit(alpha)
    assert 0 < wait <= 10.0 + 0.5  # the next one is due 60 / 6 s after the first
    assert limiters[1].admit(beta) is None


def test_a_redis_that_cannot_be_reached_admits_every_request():
    limiter = RateLimiter(1, "redis://127.0.0.1:1")  # nothing listens on port 1
    assert [limiter.admit("alpha") for _ in range(3)] == [None, None, None]


def test_a_rate_below_one_is_refused_naming_the_setting():
    with pytest.raises(SettingsError, match="rate_limit_per_min"):
        ServerSettings(rate_limit_per_min=0)
    with pytest.raises(SettingsError, match="rate_limit_per_min"):
        ServerSettings(rate_limit_per_min="5")


def test_two_gateways_on_one_redis_answer_429_with_retry_after_past_the_tenants_rate(tmp_path, redis_url, model_dir):
    """Two apps (as two gateways) with their own data folders, one Redis: three requests a minute
    for the tenant in all, whichever gateway they reach."""
    settings = ServerSettings(api_keys={"sk-a": _tenants()[0]}, rate_limit_per_min=3)
    apps = []
    for name in ("a", "b"):
        config = Config(home=tmp_path / name, models_home=model_dir.parent, kv=KVConfig(shared_url=redis_url))
        apps.append(create_app(settings, config, mem_factory=lambda c=config: KVMem(c, start_engine=False)))
    with TestClient(apps[0], headers={"Authorization": "Bearer sk-a"}) as a, \
            TestClient(apps[1], headers={"Authorization": "Bearer sk-a"}) as b:
        for app in apps:
            assert app.state.runtime.loaded.wait(120), app.state.runtime.error
        codes = [c.get("/v1/memories", params={"user_id": "u"}).status_code for c in (a, b, a, b)]
        assert codes == [200, 200, 200, 429]
        refused = b.get("/v1/memories", params={"user_id": "u"})
        assert_error(refused, 429)
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert 1 <= int(refused.headers["retry-after"]) <= 21
        assert 'kvmem_rejected_requests_total{reason="rate_limit"}' in b.get("/metrics").text
        # The MCP door at /mcp counts against the same rate, before any MCP exchange starts.
        mcp = a.post("/mcp", headers={"X-Kvmem-User-Id": "u", "Accept": "application/json, text/event-stream"},
                     json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        assert mcp.status_code == 429 and mcp.json()["error"]["code"] == "rate_limit_exceeded"
