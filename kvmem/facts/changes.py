"""A batch of reconciled changes (add with infer, kvmem/extract/): its store writes, in one go.

An LLM's decisions ADD, UPDATE or DELETE facts of one scope; kvmem.writes.apply_changes embeds
them, then hands them here to be written in one transaction of the store, so the batch lands
whole or not at all. FactStore has no batch of mixed writes otherwise, and one public call per
change would commit each and break that. A change whose fact is gone or is another scope's, or
whose text the store refuses (a duplicate), is dropped and logged, not applied.

`Changes` is FactStore's part that does it (mixed into it, as expiry.py's Expiry is, so store.py
stays a screenful); it uses the store's transactions and dialect as the rest of the class does,
on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

import builtins
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from kvmem.errors import InvalidInputError, UnknownFactError
from kvmem.facts import sql
from kvmem.facts.checks import metadata_json, new_row
from kvmem.facts.records import FactRecord, content_hash, record, vector_blob
from kvmem.facts.scope import Scope

log = logging.getLogger("kvmem.writes")  # where dropped changes have always been logged

CHANGE_EVENTS = ("ADD", "UPDATE", "DELETE")
INFER = "infer"  # the source of what an LLM's decision wrote: in the fact's metadata and its history events
INFER_SOURCE = {"source": INFER}


@dataclass(frozen=True)
class Change:
    """One decision to apply: ADD `text`, UPDATE fact `fact_id` to `text`, or DELETE `fact_id`.
    `origin`: the message the text was drawn from (searched with it, never encoded or shown)."""

    event: str
    text: str = ""
    fact_id: str | None = None
    origin: str = ""
    metadata: dict | None = None  # ADD: the new fact's; UPDATE: merged over the stored fact's
    event_time: str | None = None


@dataclass(frozen=True)
class Changed:
    """What a change did, in Mem0's terms: `event` ADD, UPDATE, DELETE, or NONE (an ADD whose
    text the scope already held); `memory` the text now (a DELETE's: the text forgotten)."""

    id: str
    memory: str
    event: str
    previous_memory: str | None = None

    def as_mem0(self) -> dict:
        out = {"id": self.id, "memory": self.memory, "event": self.event}
        return out if self.previous_memory is None else {**out, "previous_memory": self.previous_memory}


Done = tuple[Changed | None, FactRecord | None]


class Changes:
    """The batch writes of FactStore (mixed into it)."""

    def apply_changes(self, scope: Scope, prepared: builtins.list[tuple[Change, Any]],
                      expires_at: float | None) -> builtins.list[Done]:
        """Every change's store write in one transaction; `prepared`: (change, its text's vector,
        None for a DELETE) pairs, each of an event in CHANGE_EVENTS. -> per change, what it did
        (None if dropped) and the fact's record as written (None unless added or updated)."""
        with self._tx() as conn:
            done = [STEPS[c.event](self._dialect, conn, scope, c, vector, expires_at) for c, vector in prepared]
        if any(changed is not None and changed.event == "DELETE" for changed, _ in done):
            self._forgotten()
        return done


def _add_row(dialect, conn, scope: Scope, change: Change, vector, expires_at) -> Done:
    row = new_row(scope, change.text, metadata={**(change.metadata or {}), **INFER_SOURCE}, origin=change.origin,
                  event_time=change.event_time, embedding=vector, expires_at=expires_at)
    fact, created = sql.insert(conn, row, INFER)
    if not created:
        return Changed(fact.id, fact.text, "NONE"), fact
    dialect.changed(conn, "add", {"id": fact.id, "user_id": fact.user_id})
    return Changed(fact.id, fact.text, "ADD"), fact


def _update_row(dialect, conn, scope: Scope, change: Change, vector, expires_at) -> Done:
    old = _owned_row(conn, scope, change)
    if old is None:
        return None, None
    text = change.text.strip()
    if text == old["text"]:
        return Changed(old["id"], text, "NONE"), None  # Mem0's answer for a memory already so
    if _duplicate(conn, old, text):
        return None, None
    metadata = {**json.loads(old["metadata"]), **(change.metadata or {}), **INFER_SOURCE}
    now = time.time()
    columns = {"text": text, "content_hash": content_hash(text), "metadata": metadata_json(metadata),
               "origin": change.origin, "embedding": vector_blob(vector), "embedding_dim": vector.size,
               "updated_at": now}
    columns.update(kv_status="pending", kv_attempts=0)  # the blob was made from the old words
    sql.set_columns(conn, old["id"], columns)
    sql.log(conn, "UPDATE", old, old["text"], text, now, INFER)
    dialect.changed(conn, "update", old)
    return Changed(old["id"], text, "UPDATE", old["text"]), record(sql.fetch(conn, old["id"]))


def _delete_row(dialect, conn, scope: Scope, change: Change, vector, expires_at) -> Done:
    old = _owned_row(conn, scope, change)
    if old is None:
        return None, None
    sql.forget(conn, [old], INFER)
    dialect.changed(conn, "delete", old)
    return Changed(old["id"], old["text"], "DELETE"), None


def _owned_row(conn, scope: Scope, change: Change):
    """The stored row the change is about, or None (logged) when it is gone or another scope's."""
    try:
        row = sql.fetch(conn, change.fact_id)
    except (UnknownFactError, InvalidInputError):
        row = None
    if row is None or row["scope_key"] != scope.key:
        log.warning("%s of %r dropped: no such fact in scope %s", change.event, change.fact_id, scope.key)
        return None
    return row


def _duplicate(conn, old, text: str) -> bool:
    try:
        sql.refuse_duplicate(conn, old, content_hash(text))
    except InvalidInputError as e:
        log.warning("UPDATE of %r dropped: %s", old["id"], e)
        return True
    return False


STEPS = {"ADD": _add_row, "UPDATE": _update_row, "DELETE": _delete_row}  # event -> its store write
