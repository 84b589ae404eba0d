"""The shared KV tier (kv/shared.py) and KVStore over it, against a real Redis server.

Each test uses a fingerprint of its own, so its keys and forget channel are its own too.
"""

import time
import uuid

import pytest
import redis
import torch

from kvmem.errors import BlobError
from kvmem.kv.shared import SharedTier, SharedTierError, safe_url
from kvmem.kv.store import KVStore
from tests.kv.test_blob import make_blob
from kvmem.bench.servers import free_port


@pytest.fixture
def fp():
    return uuid.uuid4().hex * 2  # 64 hex digits, the first 16 unique to this test


@pytest.fixture
def stores(tmp_path, fp, redis_url):
    """open(name): a store on its own local folder (as on its own host), all on one shared tier."""
    opened = []

    def open_store(name="a", **kwargs):
        store = KVStore(tmp_path / name, fp, shared_url=redis_url, **kwargs)
        opened.append(store)
        return store

    yield open_store
    for store in opened:
        store.close()


@pytest.fixture
def client(redis_url):
    with redis.Redis.from_url(redis_url) as c:
        yield c


def key(fp, fact_id):
    return f"kvmem:kv:{fp[:16]}:{fact_id}"


def wait_until(check, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_put_writes_the_local_file_and_the_shared_tier(stores, fp, client):
    store = stores()
    blob = make_blob(fp=fp)
    store.put(blob)
    assert client.hget(key(fp, "f1"), "data") == store.path("f1").read_bytes()
    assert torch.equal(store.get("f1").value, blob.value)
    assert not list(store.dir.glob(".*")), "temp files left behind"
    assert store.shared_pulls == 0


def test_another_host_pulls_a_blob_once_then_reads_it_locally(stores, fp):
    stores("a").put(make_blob(fp=fp, seed=3))
    b = stores("b")
    assert not b.path("f1").exists()
    blob, in_ram = b.fetch("f1")
    assert torch.equal(blob.key, make_blob(fp=fp, seed=3).key) and not in_ram
    assert b.shared_pulls == 1 and b.path("f1").is_file()
    assert b.fetch("f1")[1] and b.shared_pulls == 1  # now the RAM tier's


def test_token_ids_and_warm_pull_too(stores, fp):
    a = stores("a")
    a.put(make_blob("x", fp=fp, tokens=4))
    a.put(make_blob("y", fp=fp, tokens=6))
    b = stores("b")
    assert b.token_ids("x") == make_blob(tokens=4).token_ids
    b.worker_attached = True  # warm() then loads into the RAM tier
    assert b.warm("y") == (make_blob(tokens=6).token_ids, False)
    assert b.shared_pulls == 2 and b.ram_hits == 0
    assert b.warm("y") == (make_blob(tokens=6).token_ids, True)


def test_a_blob_in_neither_tier_is_missing(stores):
    with pytest.raises(BlobError) as e:
        stores().get("never")
    assert e.value.reason == BlobError.MISSING


def test_stamp_of_a_blob_only_shared_moves_no_bytes_and_changes_on_a_put(stores, fp):
    a, b = stores("a"), stores("b")
    a.put(make_blob(fp=fp, tokens=5))
    first = b.stamp("f1")
    assert first is not None and first[1] == a.path("f1").stat().st_size
    assert b.exists("f1") and b.intact("f1")
    assert not b.path("f1").exists() and b.shared_pulls == 0
    a.put(make_blob(fp=fp, tokens=5, seed=1))
    assert b.stamp("f1") not in (None, first)
    assert b.stamp("never") is None and not b.exists("never") and not b.intact("never")


def test_a_delete_reaches_every_host(stores, fp, client):
    a, b = stores("a"), stores("b")
    a.put(make_blob(fp=fp))
    b.worker_attached = True
    b.warm("f1")  # b's local folder and RAM tier hold it now
    assert b.path("f1").is_file() and "f1" in b._hot
    assert a.delete("f1")
    assert not client.exists(key(fp, "f1"))
    wait_until(lambda: not b.path("f1").exists() and "f1" not in b._hot)
    with pytest.raises(BlobError) as e:
        b.get("f1")
    assert e.value.reason == BlobError.MISSING
    assert b.stamp("f1") is None


def test_a_host_that_missed_a_delete_drops_the_blob_when_it_starts(tmp_path, stores, fp):
    a = stores("a")
    a.put(make_blob("kept", fp=fp))
    a.put(make_blob("gone", fp=fp))
    a.close()  # down while the fact is deleted elsewhere
    stores("b").delete("gone")
    a = stores("a")
    assert not a.path("gone").exists()
    assert a.path("kept").is_file() and a.shared_pulls == 0


def test_a_host_resyncs_after_losing_its_forget_channel(stores, fp, client):
    a = stores("a")
    a.put(make_blob(fp=fp))
    stray = a.path("f1").with_name("stray.safetensors")  # e.g. a forget lost with the connection
    stray.write_bytes(a.path("f1").read_bytes())
    name = f"kvmem-forget-{fp[:16]}"
    ids = [c["id"] for c in client.client_list() if c["name"] == name]
    assert len(ids) == 1
    client.client_kill_filter(_id=ids[0])
    wait_until(lambda: not stray.exists())
    assert a.path("f1").is_file()
    stores("b").delete("f1")  # and it hears forgets again
    wait_until(lambda: not a.path("f1").exists())


def test_a_put_that_cannot_reach_the_shared_tier_fails_and_leaves_no_file(tmp_path, fp):
    url = f"redis://:secret@127.0.0.1:{free_port()}/0"  # nothing listens there
    start = time.monotonic()
    store = KVStore(tmp_path, fp, shared_url=url)
    try:
        assert time.monotonic() - start < 5, "a dead shared tier must not hold up start-up"
        with pytest.raises(SharedTierError) as e:
            store.put(make_blob(fp=fp))
        assert isinstance(e.value, BlobError) and isinstance(e.value, OSError)  # the blob writer logs OSErrors
        assert "127.0.0.1" in str(e.value) and "secret" not in str(e.value)
        assert not (store.dir.exists() and any(store.dir.iterdir())), "a file left behind"
        with pytest.raises(BlobError) as e:
            store.get("f1")
        assert e.value.reason == BlobError.MISSING
        assert store.stamp("f1") is None
        with pytest.raises(SharedTierError):
            store.delete("f1")
    finally:
        store.close()


def test_shared_tier_api(redis_url, fp):
    tier = SharedTier(redis_url, fp)
    try:
        version, size = tier.put("a:1", b"abc")
        assert tier.stamp("a:1") == (version, 3) and size == 3
        assert tier.get("a:1") == (b"abc", version)
        assert tier.put("a:1", b"abcd")[0] != version
        tier.put("b", b"x")
        assert sorted(tier.ids()) == ["a:1", "b"]
        assert tier.present(["a:1", "c"]) == {"a:1": True, "c": False}
        heard = []
        close = tier.subscribe(heard.append)
        wait_until(lambda: heard == [None])  # a subscription starts with a resync
        assert tier.delete("b") and not tier.delete("b")
        wait_until(lambda: heard == [None, "b", "b"])
        close()
        assert tier.get("b") is None and tier.stamp("b") is None
    finally:
        tier.close()


def test_urls_in_messages_hide_passwords():
    assert safe_url("redis://user:pw@host:6379/0") == "redis://user:***@host:6379/0"
    assert safe_url("redis://host:6379/0") == "redis://host:6379/0"


def test_shared_stores_are_per_tier(tmp_path, fp, redis_url):
    local = KVStore.shared(tmp_path, fp)
    shared = KVStore.shared(tmp_path, fp, shared_url=redis_url)
    try:
        assert local is not shared and KVStore.shared(tmp_path, fp, shared_url=redis_url) is shared
        assert local._tier is None and local._unsubscribe is None
    finally:
        shared.close()
        for url in (None, redis_url):
            KVStore._shared.pop((str(tmp_path.resolve()), fp, 512 << 20, url))


def test_a_pull_that_races_a_re_encode_reads_the_new_version(stores, fp):
    """Host b reads version 1 while host a replaces it with version 2 before b installs it: b must
    read again and serve version 2, not report the blob missing (a gateway re-encoding a fact
    while a replica pulls it; the cause of a flaky topology test)."""
    a, b = stores("a"), stores("b")
    a.put(make_blob(fp=fp, seed=3))
    real_get, raced = b._tier.get, []

    def get_then_replaced(fact_id):
        got = real_get(fact_id)
        if not raced:
            raced.append(True)
            a.put(make_blob(fp=fp, seed=4))  # the version just read is gone before b installs it
        return got

    b._tier.get = get_then_replaced
    blob, _ = b.fetch("f1")
    assert torch.equal(blob.key, make_blob(fp=fp, seed=4).key) and b.shared_pulls == 1
