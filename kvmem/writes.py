"""The write path: facts stored, indexed and encoded in step.

Writes store and index first, under the service's write lock, then encode (outside it: encoding
runs the engine). A fact without usable KV is served by text prefill and re-encoded in the
background. Forgetting a fact, for whatever reason, goes through one path (`_forget`): out of
both indexes (Retrieval.unindex, which also frees its place in the disk budget) and its blob gone.
Expired facts (kvmem.facts.expiry) leave by that path too, swept at the start of every add and on
demand (`sweep_expired`). A batch of reconciled changes (`apply_changes`, for add with infer)
is written in one store transaction (kvmem.facts.changes), so it lands whole or not at all.
"""

from __future__ import annotations

import logging
import threading
import time

from kvmem.config import Config
from kvmem.errors import InvalidInputError
from kvmem.facts.changes import CHANGE_EVENTS, Change, Changed
from kvmem.facts.expiry import KEEP, expires_at_of
from kvmem.facts.inputs import CheckText, fact_items
from kvmem.facts.scope import Scope
from kvmem.facts.store import FactRecord
from kvmem.keeper import BlobKeeper, check_encode_mode
from kvmem.results import AddResult, EncodeReport
from kvmem.retrieval import Retrieval, metadata_filter

log = logging.getLogger("kvmem.writes")


class Writes:
    def __init__(self, config: Config, facts, retrieval: Retrieval, keeper: BlobKeeper, check_text: CheckText,
                 lock: threading.RLock) -> None:
        """`check_text(text, context)`: a fact's text as stored, or InvalidInputError when it does
        not fit the model (chat.Chats.check_fact)."""
        self.config, self.facts, self.retrieval, self.keeper = config, facts, retrieval, keeper
        self._check_text = check_text
        self._lock = lock

    def add(self, messages, scope: Scope, *, facts, metadata, context, window, encode, timestamp,
            origin, from_turn: int = 0, expiration_date=None) -> AddResult:
        """`from_turn`: store only a conversation's turns from this index on (those before are
        still the window the first of them is encoded after). `expiration_date`: Mem0's, for
        every fact of the call (kvmem.facts.expiry)."""
        check_encode_mode(encode)
        expires_at = expires_at_of(expiration_date)
        self.sweep_expired()
        items = fact_items(messages, facts, context=context, metadata=metadata, timestamp=timestamp, origin=origin,
                           window=self.config.memory.window if window is None else window,
                           template=self.config.prompt.fact_template, check_text=self._check_text)
        items = [i for i in items if i.get("position", 0) >= from_turn]
        if not items:
            return AddResult((), 0, 0, None)
        vectors = self.retrieval.vectors([i["text"] for i in items], [i["context"] for i in items],
                                         [i.get("origin", "") for i in items])  # [n, dim]
        with self._lock:
            pairs = self.facts.add_many([dict(i, scope=scope, embedding=v, expires_at=expires_at)
                                         for i, v in zip(items, vectors)])
            new = [r for r, created in pairs if created]
            for r in new:
                self.retrieval.index(r, r.embedding)
        report = self.keeper.encode(new, encode)
        return AddResult(tuple(r.id for r, _ in pairs), len(new), len(pairs) - len(new), report,
                         new_ids=tuple(r.id for r in new))

    def remember(self, messages: list[dict], reply: str, scope: Scope, store: str) -> tuple[str, ...]:
        """A chat's write-back: its last user turn ("user"), and the reply too ("both"), stored as
        turn facts of the scope, encoded in the background after the turns before them (CWE).
        -> the stored ids (duplicates included: what the scope now holds for them)."""
        turns = messages + ([{"role": "assistant", "content": reply}] if store == "both" and reply.strip() else [])
        last_user = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=None)
        if store == "none" or last_user is None:
            return ()
        added = self.add(turns, scope, facts=None, metadata=None, context="", window=None, encode="background",
                         timestamp=None, origin="", from_turn=last_user)
        return added.ids

    def update(self, fact_id: str, text: str, metadata: dict | None, expiration_date=KEEP) -> FactRecord:
        """`expiration_date`: a new expiry, None for never; left out (KEEP), the fact keeps its own."""
        expires_at = KEEP if expiration_date is KEEP else expires_at_of(expiration_date)
        old = self.facts.get(fact_id)
        self._check_text(text, old.context)
        vector = self.retrieval.vectors([text.strip()], [old.context], [old.origin])[0]
        with self._lock:
            record = self.facts.update(fact_id, text.strip(), metadata=metadata, embedding=vector)
            if expires_at is not KEEP:
                self.facts.set_expiry(fact_id, expires_at)
            if record.text != old.text:
                self.keeper.drop(fact_id)  # the old KV must never serve the new text
            self.retrieval.index(record, vector)
        if record.text != old.text:
            self.keeper.encode([record], "sync")
        return self.facts.get(fact_id)

    def delete(self, fact_id: str) -> None:
        with self._lock:
            record = self.facts.delete(fact_id)
            self._forget(record.scope.user_id, [fact_id])

    def delete_all(self, scope: Scope, filters: dict | None = None) -> int:
        """The scope's facts whose metadata `filters` match (all of them without), forgotten."""
        where = metadata_filter(filters)  # checked before the lock: a bad filter deletes nothing
        with self._lock:
            ids = self.facts.delete_scope(scope, where=where)
            self._forget(scope.user_id, ids)
        return len(ids)

    def sweep_expired(self, now: float | None = None) -> int:
        """Forget every fact expired by `now` (default: now) from every store, as a delete does:
        text and history words, both indexes, the KV blob in every tier; -> how many."""
        with self._lock:
            gone = self.facts.delete_expired(time.time() if now is None else now)
            for record in gone:
                self._forget(record.scope.user_id, [record.id])
        return len(gone)

    def _forget(self, user_id: str, fact_ids: list[str]) -> None:
        for fact_id in fact_ids:
            self.retrieval.unindex(user_id, fact_id)
            self.keeper.drop(fact_id)

    def reset(self) -> None:
        with self._lock:
            self.keeper.reset()
            self.facts.reset()
            self.retrieval.rebuild()  # empty now


# -- a batch of reconciled changes (add(..., infer=True): kvmem/extract/) --------------------------
# Change and Changed live with the store writes (kvmem.facts.changes); extract imports them here.


def apply_changes(writes: Writes, changes: list[Change], scope: Scope, *, encode: str = "background",
                  expiration_date=None) -> tuple[list[Changed], EncodeReport | None]:
    """Apply a batch all or nothing: every store write in one transaction (a failure in any of
    them rolls them all back, before an index or a blob is touched); then the indexes and blobs
    follow what was committed. An UPDATE or DELETE whose fact is gone or is not the scope's, and
    a text that cannot be stored (too long, a duplicate), are dropped and logged, not applied."""
    check_encode_mode(encode)
    expires_at = expires_at_of(expiration_date)
    writes.sweep_expired()
    kept = [c for c in changes if _storable(writes, c)]
    texts = [c for c in kept if c.event != "DELETE"]
    vectors = iter(writes.retrieval.vectors([c.text for c in texts], [""] * len(texts), [c.origin for c in texts])
                   if texts else [])
    prepared = [(c, None if c.event == "DELETE" else next(vectors)) for c in kept]
    with writes._lock:
        done = writes.facts.apply_changes(scope, prepared, expires_at)
        for (_, vector), (changed, record) in zip(prepared, done):
            event = changed.event if changed is not None else None
            if event == "DELETE":
                writes._forget(scope.user_id, [changed.id])
            elif event in ("ADD", "UPDATE"):
                if event == "UPDATE":
                    writes.keeper.drop(changed.id)  # the old KV must never serve the new text
                writes.retrieval.index(record, vector)
    results = [changed for changed, _ in done if changed is not None]
    fresh = [record for changed, record in done if changed is not None and changed.event in ("ADD", "UPDATE")]
    return results, writes.keeper.encode(fresh, encode)


def _storable(writes: Writes, change: Change) -> bool:
    if change.event not in CHANGE_EVENTS or (change.event != "ADD" and not change.fact_id):
        log.warning("change dropped (not an ADD, UPDATE or DELETE of a fact): %r", change)
        return False
    if change.event == "DELETE":
        return True
    try:
        writes._check_text(change.text, "")
    except InvalidInputError as e:
        log.warning("change dropped (%s): %r", e, change)
        return False
    return True
