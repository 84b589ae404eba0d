"""Finding a user's facts: search vectors, the dense and lexical indexes, and hybrid ranking.

Both indexes hold every stored fact, keyed by user, with the fact's metadata and scope for
filters. They are kept in step with the fact store by the callers' writes (`index`, `unindex`)
and, with PostgreSQL, by the store's change feed (`on_change`), which also carries the other
processes' writes. Forgetting a fact has one path, `unindex`, whatever the reason: a delete,
a delete_all, or another process's delete heard on the feed.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from tqdm import tqdm

from kvmem.config import RETRIEVAL_MODES, RetrievalConfig
from kvmem.embed.fact import fact_vectors
from kvmem.errors import InvalidInputError, UnknownFactError
from kvmem.facts.inputs import int_at_least
from kvmem.facts.scope import Scope
from kvmem.facts.store import MAX_LIMIT, FactRecord
from kvmem.facts.text import check_nested, check_unicode, search_text
from kvmem.index import Hit, fusion, matcher, validate_filters
from kvmem.index.lexical import LexicalIndex
from kvmem.index.tiered import TieredIndex
from kvmem.results import SearchHit


class Retrieval:
    def __init__(self, facts, embedder, config: RetrievalConfig, lock: threading.RLock,
                 on_unindex: Callable[[str], None] = lambda fact_id: None) -> None:
        """`lock`: the service's write lock, which keeps the store, the indexes and the blobs in
        step. `on_unindex(fact_id)`: told of every fact forgotten here (the blob keeper's budget)."""
        self.facts, self.embedder, self.config = facts, embedder, config
        self._lock = lock
        self._on_unindex = on_unindex
        with lock:
            # Other processes' writes (PostgreSQL; SQLite has one owner) are heard from before the
            # indexes are read from the store, and applied after (the lock holds them back), so
            # none made meanwhile is missed.
            self._unsubscribe = facts.subscribe(self.on_change)
            self.dense, self.lexical = self._build()

    def vectors(self, texts: list[str], contexts: list[str], origins: list[str]):
        """Search vectors of facts [n, dim], made as every stored fact's is (kvmem.embed.fact)."""
        return fact_vectors(self.embedder, texts, contexts, origins)

    # -- keeping the indexes in step (callers hold the write lock) ----------------------------

    def _build(self) -> tuple[TieredIndex, LexicalIndex]:
        """Dense and lexical indexes of every stored fact (built aside, so searches meanwhile
        keep using the old ones)."""
        dense, lexical = TieredIndex(self.embedder.dim), LexicalIndex()  # exact scan; graph past 20k facts
        # From the embeddings rows alone: one SQL read per fact made start-up O(n) round trips.
        for fact_id, scope_key, vector, metadata in self.facts.embeddings():
            scope = Scope.from_key(scope_key)
            dense.add(scope.user_id, [fact_id], vector[None, :], [index_metadata(scope, metadata)])
        for fact_id, scope_key, text, context, origin, metadata in self.facts.texts():
            scope = Scope.from_key(scope_key)
            lexical.add(scope.user_id, [fact_id], [search_text(text, context, origin)],
                        [index_metadata(scope, metadata)])
        return dense, lexical

    def rebuild(self) -> None:
        with self._lock:
            self.dense, self.lexical = self._build()

    def index(self, record: FactRecord, vector) -> None:
        """Both indexes, in step."""
        meta = [index_metadata(record.scope, record.metadata)]
        self.dense.add(record.scope.user_id, [record.id], vector[None, :], meta)
        self.lexical.add(record.scope.user_id, [record.id],
                         [search_text(record.text, record.context, record.origin)], meta)

    def unindex(self, user_id: str, fact_id: str) -> None:
        """A forgotten fact leaves both indexes, and whoever keeps its blob hears of it."""
        self.dense.remove(user_id, fact_id)
        self.lexical.remove(user_id, fact_id)
        self._on_unindex(fact_id)

    def on_change(self, change: dict) -> None:
        """A committed write to the shared fact store, by this process or another (the store's
        listener thread). Each change is applied by reading the fact as it is now, so late,
        repeated or reordered notifications all converge on the store's state."""
        op, fact_id = change.get("op"), change.get("id")
        if op in ("reset", "resync"):
            self.rebuild()
            return
        try:
            record = self.facts.get(fact_id)
        except UnknownFactError:  # deleted (now or since): gone from the indexes too
            if change.get("user_id"):
                with self._lock:
                    self.unindex(change["user_id"], fact_id)
            return
        with self._lock:
            if record.embedding is not None:
                self.index(record, record.embedding)
            else:  # its text changed and the new vector is not stored yet: found by words only
                self.dense.remove(record.scope.user_id, record.id)
                self.lexical.add(record.scope.user_id, [record.id],
                                 [search_text(record.text, record.context, record.origin)],
                                 [index_metadata(record.scope, record.metadata)])

    def reembed(self, *, user_id: str | None = None, batch: int = 256, progress: bool = False) -> int:
        """Recompute every stored fact's search vector (one user's with `user_id`) and re-index
        it; -> how many were rewritten. Each batch is written on its own, so an interrupted run
        loses nothing and a rerun redoes it; a fact whose text changes meanwhile keeps the
        vector its update made (the write is skipped)."""
        if user_id is not None:
            Scope(user_id)
        if not int_at_least(batch, 1):
            raise InvalidInputError(f"batch must be an int >= 1, got {batch!r}", param="batch")
        total = self.facts.count(user_id=user_id) if progress else None
        done = offset = 0
        with tqdm(total=total, desc="re-embedding facts", unit="fact", disable=not progress) as bar:
            while page := self.facts.list(user_id=user_id, limit=min(batch, MAX_LIMIT), offset=offset):
                done += self._reembed_page(page)
                offset += len(page)
                bar.update(len(page))
        return done

    def _reembed_page(self, page: list[FactRecord]) -> int:
        vectors = self.vectors([r.text for r in page], [r.context for r in page], [r.origin for r in page])  # [n, dim]
        done = 0
        with self._lock:
            for record, vector in zip(page, vectors):
                try:
                    if not self.facts.set_embedding(record.id, vector, if_text=record.text):
                        continue  # updated meanwhile: its update stored a vector of its own
                except UnknownFactError:
                    continue  # deleted meanwhile
                self.index(self.facts.get(record.id), vector)
                done += 1
        return done

    # -- searching ------------------------------------------------------------------------------

    def get_all(self, *, user_id: str, agent_id: str | None = None, run_id: str | None = None,
                filters: dict | None = None, limit: int = 100, offset: int = 0) -> list[FactRecord]:
        """The scope's facts in stored order, those whose metadata `filters` match (no ranking)."""
        Scope(user_id, agent_id, run_id)
        return self.facts.list(user_id=user_id, agent_id=agent_id, run_id=run_id, limit=limit, offset=offset,
                               where=metadata_filter(filters), live_at=time.time())

    def count(self, *, user_id: str, agent_id: str | None = None, run_id: str | None = None,
              filters: dict | None = None) -> int:
        """How many facts get_all would list without its limit."""
        Scope(user_id, agent_id, run_id)
        return self.facts.count(user_id, agent_id, run_id, where=metadata_filter(filters), live_at=time.time())

    def search(self, query: str, *, user_id: str, agent_id: str | None = None, run_id: str | None = None,
               k: int = 10, filters: dict | None = None, ranking: str | None = None) -> list[SearchHit]:
        """The scope's top-k facts for `query`, expired ones left out; `ranking` ("hybrid", "dense",
        "lexical") overrides RetrievalConfig.mode for this call."""
        return [hit for hit, _ in self.search_facts(query, user_id=user_id, agent_id=agent_id, run_id=run_id, k=k,
                                                    filters=filters, ranking=ranking)]

    def search_facts(self, query: str, *, user_id: str, agent_id: str | None = None, run_id: str | None = None,
                     k: int = 10, filters: dict | None = None,
                     ranking: str | None = None) -> list[tuple[SearchHit, FactRecord]]:
        """`search`, each hit with the fact record it was read from (a chat builds its prompt from
        them: no second read, in which a fact deleted meanwhile would be missing)."""
        Scope(user_id, agent_id, run_id)
        if not int_at_least(k, 1):
            raise InvalidInputError(f"k must be an int >= 1, got {k!r}", param="k")
        if ranking is not None and ranking not in RETRIEVAL_MODES:
            raise InvalidInputError(f"ranking must be one of {RETRIEVAL_MODES}, got {ranking!r}", param="ranking")
        if not isinstance(query, str) or not query.strip():
            raise InvalidInputError("query must be a non-empty string", param="query")
        check_unicode("query", query)
        check_nested("filters", filters)
        validate_filters(filters or {})  # the user's own filters, checked before scope keys join them
        conditions = {**(filters or {}), **{k_: v for k_, v in (("_agent_id", agent_id), ("_run_id", run_id)) if v}}
        mode = ranking or self.config.mode
        vector = None if mode == "lexical" else self.embedder.embed([query])[0]
        records = self._live(user_id, query, vector, k, validate_filters(conditions) if conditions else None, mode)
        return [(SearchHit(r.id, r.text, float(h.score), r.metadata, r.created_at, r.kv_status), r) for h, r in records]

    def _live(self, user_id: str, query: str, vector, k: int, conditions, mode: str) -> list[tuple[Hit, FactRecord]]:
        """The top k hits whose facts have not expired, ranked deeper by as many as had, until k
        are live or the ranking runs out: expired facts stay indexed until the sweep forgets them.
        A hit whose row is gone (another process deleted it, and its change feed has not reached
        these indexes yet) is left out the same way."""
        now, depth = time.time(), k
        while True:
            hits = self._rank(user_id, query, vector, depth, conditions, mode)
            records = [(h, self._record(h.id)) for h in hits]
            live = [(h, r) for h, r in records if r is not None and not r.expired(now)]
            if len(live) >= k or len(hits) < depth:
                return live[:k]
            depth = k + len(records) - len(live)  # > depth: more than depth - k of them had expired

    def _record(self, fact_id: str) -> FactRecord | None:
        """A ranked fact's record, None where its row is gone (deleted since it was ranked)."""
        try:
            return self.facts.get(fact_id)
        except UnknownFactError:
            return None

    def warm(self) -> None:
        """One hybrid search through throwaway indexes, so that the query embedder's weights and
        the compiled ranking kernels (numba) load now rather than in a user's first search: that
        one took ~1 s on a 2-core host, where later ones take tens of ms. The graph tier's kernels
        (scopes past 20k facts) still load on their first graph search."""
        texts = ["kvmem warm-up", "another warm-up fact"]
        vectors = self.embedder.embed(texts)  # [2, dim]
        dense, lexical = TieredIndex(self.embedder.dim), LexicalIndex()
        dense.add("warm-up", ["w0", "w1"], vectors, [{}, {}])
        lexical.add("warm-up", ["w0", "w1"], texts, [{}, {}])
        fusion.hybrid_search(dense, lexical, "warm-up", vectors[0], texts[0], 1, None, self.config.depth,
                             self.config.dense_weight)

    def _rank(self, user_id: str, query: str, vector, k: int, conditions, mode: str) -> list[Hit]:
        if mode == "lexical":
            return self.lexical.search(user_id, query, k, conditions)
        if mode == "dense":
            return self.dense.search(user_id, vector, k, conditions)
        return fusion.hybrid_search(self.dense, self.lexical, user_id, vector, query, k, conditions,
                                    self.config.depth, self.config.dense_weight)

    def close(self) -> None:
        self._unsubscribe()


def metadata_filter(filters: dict | None) -> Callable[[dict], bool] | None:
    """`filters` checked and compiled once, as the fact store's `where(metadata)`; None for none."""
    check_nested("filters", filters)
    norm = validate_filters(filters) if filters else None
    return matcher(norm) if norm else None


def index_metadata(scope: Scope, metadata: dict) -> dict:
    """A fact's metadata as the indexes filter on it: the scope's agent and run join it."""
    return {**metadata, "_agent_id": scope.agent_id, "_run_id": scope.run_id}
