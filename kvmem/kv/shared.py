"""The shared KV tier: every blob of a model in Redis (or Valkey), for processes on many hosts.

One hash per blob, `kvmem:kv:<fingerprint[:16]>:<fact_id>`, with fields `data` (the encoded blob,
as the local file holds it) and `version` (a fresh uuid per put). A stamp, (version, size), is one
round-trip that moves no blob bytes. A delete also publishes the fact id on
`kvmem:kv:<fingerprint[:16]>:forget`, so every process drops its local copy (`subscribe`).
Pub/sub is fire-and-forget: a subscriber that lost its connection cannot know what it missed, so
after every (re)subscription it is told to resync (`on_forget(None)`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.exceptions import ConnectionError as RedisConnectionError, RedisError, TimeoutError as RedisTimeoutError

from kvmem.errors import BlobError

log = logging.getLogger("kvmem.kv")

CONNECT_TIMEOUT_S = 2.0  # a dead host must not stall an engine step for long
SOCKET_TIMEOUT_S = 10.0  # per socket operation, so a large blob may take longer in all
RETRY_AFTER_S = 1.0  # after a connection failure, calls fail at once for this long
_BATCH = 1000  # keys per pipelined round-trip


class SharedTierError(BlobError, OSError):
    """The shared tier could not be reached or refused a command. A BlobError (MISSING: a blob
    that cannot be read cannot be injected) and an OSError (a write that failed, as a disk's
    would, for callers that already handle those)."""

    def __init__(self, fact_id: str, url: str, detail: str) -> None:
        super().__init__(fact_id, BlobError.MISSING, f"shared KV tier {url}: {detail}")


def safe_url(url: str) -> str:
    """The URL without its password, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


class SharedTier:
    def __init__(self, url: str, fingerprint: str) -> None:
        self.url = safe_url(url)
        fp = fingerprint[:16]
        self.prefix = f"kvmem:kv:{fp}:"
        self.channel = f"kvmem:kv:{fp}:forget"
        # One retry (a pooled connection may have died with a server restart), not redis-py's
        # default three with backoff, which would multiply the wait on a dead host.
        options = dict(socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=CONNECT_TIMEOUT_S,
                       socket_keepalive=True, health_check_interval=30, retry=Retry(NoBackoff(), 1))
        try:
            self._client = redis.Redis.from_url(url, client_name=f"kvmem-kv-{fp}", **options)
            # A connection of its own, named, so an operator (or a test) can find the subscriber.
            self._listener = redis.Redis.from_url(url, client_name=f"kvmem-forget-{fp}", **options)
        except ValueError as e:
            raise SharedTierError("*", self.url, f"bad URL: {e}") from None
        self._down_until = 0.0

    def key(self, fact_id: str) -> str:
        return self.prefix + fact_id

    def put(self, fact_id: str, data: bytes | bytearray) -> tuple[str, int]:
        version = uuid.uuid4().hex
        fields = {"data": bytes(data), "version": version}
        self._call(fact_id, lambda: self._client.hset(self.key(fact_id), mapping=fields))
        return version, len(data)

    def stamp(self, fact_id: str) -> tuple[str, int] | None:
        """(version, size) of the stored blob, None when there is none; the bytes stay there."""
        def run():
            pipe = self._client.pipeline(transaction=False)
            pipe.hget(self.key(fact_id), "version")
            pipe.hstrlen(self.key(fact_id), "data")
            return pipe.execute()
        version, size = self._call(fact_id, run)
        return None if version is None else (version.decode(), int(size))

    def version(self, fact_id: str) -> str | None:
        version = self._call(fact_id, lambda: self._client.hget(self.key(fact_id), "version"))
        return None if version is None else version.decode()

    def get(self, fact_id: str) -> tuple[bytes, str] | None:
        data, version = self._call(fact_id, lambda: self._client.hmget(self.key(fact_id), ["data", "version"]))
        return None if data is None or version is None else (data, version.decode())

    def delete(self, fact_id: str) -> bool:
        """Removes the blob and tells every subscriber to forget it (even when it was not here:
        a stray local copy must go too)."""
        def run():
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(self.key(fact_id))
            pipe.publish(self.channel, fact_id)
            return pipe.execute()
        return bool(self._call(fact_id, run)[0])

    def ids(self) -> Iterator[str]:
        """Every fact id with a blob here (SCAN: cost grows with the whole tier)."""
        keys = self._call("*", lambda: list(self._client.scan_iter(match=self.prefix + "*", count=_BATCH)))
        for key in keys:
            yield key.decode()[len(self.prefix):]

    def present(self, fact_ids: Iterable[str]) -> dict[str, bool]:
        """Which of these fact ids have a blob here (pipelined: cost grows with the ids asked)."""
        fact_ids = list(fact_ids)
        found: dict[str, bool] = {}
        for i in range(0, len(fact_ids), _BATCH):
            chunk = fact_ids[i:i + _BATCH]
            def run(chunk=chunk):
                pipe = self._client.pipeline(transaction=False)
                for fact_id in chunk:
                    pipe.exists(self.key(fact_id))
                return pipe.execute()
            found.update(zip(chunk, map(bool, self._call("*", run))))
        return found

    def subscribe(self, on_forget: Callable[[str | None], None],
                  ready: threading.Event | None = None) -> Callable[[], None]:
        """Calls on_forget(fact_id) for each delete, from a daemon thread, and on_forget(None)
        after each (re)subscription, the first included: messages may have been missed. `ready`
        is set once the first attempt is over (subscribed and resynced, or failed). -> a closer."""
        stop = threading.Event()
        thread = threading.Thread(target=self._listen, args=(on_forget, stop, ready or threading.Event()),
                                  name="kvmem-kv-forget", daemon=True)
        thread.start()

        def close() -> None:
            stop.set()
            thread.join(timeout=5)
        return close

    def close(self) -> None:
        self._client.close()
        self._listener.close()

    def _listen(self, on_forget, stop: threading.Event, ready: threading.Event) -> None:
        delay = 0.1
        while not stop.is_set():
            pubsub = self._listener.pubsub()
            try:
                pubsub.subscribe(self.channel)
                while not stop.is_set():
                    message = pubsub.get_message(timeout=0.25)  # also how long close() waits
                    if message is not None and self._deliver(message, on_forget):
                        delay = 0.1
                        ready.set()
            except (RedisError, OSError) as e:
                if not stop.is_set():
                    log.warning("shared KV tier %s: forget channel lost (%s); retrying in %.1f s", self.url, e, delay)
            finally:
                pubsub.close()
                ready.set()
            stop.wait(delay)
            delay = min(delay * 2, 5.0)

    def _deliver(self, message: dict, on_forget) -> bool:
        """-> whether it was a subscription (which calls for a resync). A resync that fails (the
        tier answers the subscriber but not yet the client, which fails fast for RETRY_AFTER_S
        after an outage) raises, so the listener subscribes again and resyncs again: forgets
        missed while away must not be dropped."""
        kind = message.get("type")
        if kind not in ("subscribe", "message"):
            return False
        fact_id = message["data"].decode() if kind == "message" else None
        try:
            on_forget(fact_id)
        except Exception as e:  # noqa: BLE001 - the listener must outlive one bad callback
            if fact_id is None:
                raise RedisConnectionError(f"resync failed: {e}") from e
            log.exception("shared KV tier %s: forgetting %s failed", self.url, fact_id)
        return kind == "subscribe"

    def _call(self, fact_id: str, fn):
        if time.monotonic() < self._down_until:
            raise SharedTierError(fact_id, self.url, "unreachable (failed moments ago)")
        try:
            return fn()
        except (RedisConnectionError, RedisTimeoutError) as e:
            self._down_until = time.monotonic() + RETRY_AFTER_S
            raise SharedTierError(fact_id, self.url, f"unreachable: {e}") from e
        except RedisError as e:
            raise SharedTierError(fact_id, self.url, str(e)) from e
