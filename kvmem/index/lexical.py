"""`LexicalIndex`: BM25 over fact texts, per scope, kept in step with every write.

Dense MiniLM vectors miss what a question names exactly (a person, a place, a band, a date);
BM25 finds those. Each scope is an inverted index over rows (term -> rows and counts), updated
on add, update and delete (see _Scope), so it never needs a rebuild and always ranks as one
would (tests/index/test_lexical.py checks that against a fresh index).
"""

from __future__ import annotations

import heapq
import math
import re
import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from kvmem.index.base import Hit
from kvmem.index.checks import check_ids, check_metadatas, check_scope
from kvmem.index.filters import Filters, matcher, validate_filters
from kvmem.index.heap import at_cut, scatter_add

K1, B = 1.5, 0.75  # Lucene's BM25 constants; LoCoMo recall is flat across k1 0.9-2 and b 0.3-1
_IMPACT_TERMS = 4096  # query terms whose BM25 shares a scope remembers between writes

_WORD = re.compile(r"(?u)\b\w\w+\b")  # words of two characters or more
# NLTK's English stopwords, plus "would" and "could" (on LoCoMo tuning conversations this list
# beat bm25s' 33 words by 0.009 recall@10).
STOPWORDS = frozenset("""i me my myself we our ours ourselves you your yours yourself yourselves he him his himself
she her hers herself it its itself they them their theirs themselves what which who whom this that these those am
is are was were be been being have has had having do does did doing a an the and but if or because as until while
of at by for with about against between into through during before after above below to from up down in out on off
over under again further then once here there when where why how all any both each few more most other some such no
nor not only own same so than too very s t can will just don should now d ll m o re ve y ain aren couldn didn doesn
hadn hasn haven isn ma mightn mustn needn shan shouldn wasn weren won wouldn would could""".split())


@lru_cache(maxsize=1)
def _stemmer():
    import Stemmer  # PyStemmer: Snowball's English stemmer, C speed

    return Stemmer.Stemmer("english")


def terms(text: str) -> list[str]:
    """Lower-cased, stopwords out, Snowball-stemmed words ("paints", "painting" -> "paint");
    stemming was worth +0.05 recall@10 on the LoCoMo tuning conversations."""
    return _stemmer().stemWords([w for w in _WORD.findall(text.lower()) if w not in STOPWORDS])


class _Scope:
    """One scope's inverted index over rows: postings are append-only (row, count) arrays per
    term; a removed or replaced fact's row is marked dead and skipped, and the rows are
    compacted once the dead outnumber the live, so every write stays O(its own terms)."""

    def __init__(self) -> None:
        self.rows: dict[str, int] = {}  # live id -> row
        self.ids: list[str | None] = []  # row -> id (None once dead)
        self.counts: list[Counter | None] = []  # row -> its term counts (kept for compaction)
        self.metas: list[Mapping[str, Any] | None] = []
        self.lengths = np.zeros(16, dtype=np.float64)  # [capacity] terms per row
        self.alive = np.zeros(16, dtype=bool)  # [capacity] row holds a live fact
        self.postings: dict[str, tuple[list[int], list[int]]] = {}  # term -> (rows, counts)
        self._arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # term -> postings as arrays
        self._impacts: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # term -> live rows, BM25 share
        self.total = 0  # terms over the live rows

    def __len__(self) -> int:
        return len(self.rows)

    def upsert(self, fact_id: str, text: str, meta: Mapping[str, Any] | None) -> None:
        self.remove(fact_id)
        self._append(fact_id, Counter(terms(text)), meta)

    def _append(self, fact_id: str, counts: Counter, meta) -> None:
        row = len(self.ids)
        if row == len(self.lengths):  # doubling: amortised O(1) per row
            self.lengths = np.concatenate([self.lengths, np.zeros(row, dtype=np.float64)])
            self.alive = np.concatenate([self.alive, np.zeros(row, dtype=bool)])
        self.rows[fact_id] = row
        self.ids.append(fact_id)
        self.counts.append(counts)
        self.metas.append(meta)
        self.lengths[row] = sum(counts.values())
        self.alive[row] = True
        self.total += int(self.lengths[row])
        self._impacts.clear()
        for term, n in counts.items():
            rows, tfs = self.postings.setdefault(term, ([], []))
            rows.append(row)
            tfs.append(n)
            self._arrays.pop(term, None)

    def remove(self, fact_id: str) -> bool:
        row = self.rows.pop(fact_id, None)
        if row is None:
            return False
        self.total -= int(self.lengths[row])
        self.alive[row] = False
        self._impacts.clear()
        self.ids[row] = self.counts[row] = self.metas[row] = None
        if len(self.ids) > 32 and len(self.ids) > 2 * len(self.rows):
            self._compact()
        return True

    def _compact(self) -> None:
        live = [(i, c, m) for i, c, m in zip(self.ids, self.counts, self.metas) if i is not None]
        self.__init__()
        for fact_id, counts, meta in live:
            self._append(fact_id, counts, meta)

    def scores(self, query_terms: list[str]) -> np.ndarray:
        """BM25 of every row [rows] (dead rows and rows sharing no term score 0)."""
        out = np.zeros(len(self.ids), dtype=np.float64)
        for term in set(query_terms):
            rows, impact = self._impact(term)
            scatter_add(out, rows, impact)
        return out

    def _impact(self, term: str) -> tuple[np.ndarray, np.ndarray]:
        """The live rows holding `term` and its share of their BM25 [p], remembered until the
        next write: every write moves the row count and mean length the share depends on, and
        between writes a repeated term then costs one scatter-add (BM25 at 10k facts took
        ~0.5 ms recomputing every share per query)."""
        cached = self._impacts.get(term)
        if cached is not None:
            return cached
        if term not in self.postings or not self.rows:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        rows, tfs = self._postings(term)
        live = self.alive[rows]
        rows, tfs = rows[live], tfs[live]
        n = len(self.rows)
        avg = self.total / n if self.total else 1.0
        idf = math.log(1 + (n - len(rows) + 0.5) / (len(rows) + 0.5))
        impact = idf * tfs * (K1 + 1) / (tfs + K1 * (1 - B + B * self.lengths[rows] / avg))  # [p]
        if len(self._impacts) >= _IMPACT_TERMS:
            self._impacts.clear()
        self._impacts[term] = (rows, impact)
        return rows, impact

    def _postings(self, term: str) -> tuple[np.ndarray, np.ndarray]:
        cached = self._arrays.get(term)
        if cached is None:
            rows, tfs = self.postings[term]
            cached = self._arrays[term] = (np.asarray(rows, dtype=np.int64), np.asarray(tfs, dtype=np.float64))
        return cached


def _top_rows(vec: np.ndarray, top: int, ids: list[str | None]) -> np.ndarray:
    """The `top` rows by vec [rows] (more than `top` of them positive), ties at the cut broken
    by smaller id.

    Keeping every tie instead let a query of common words carry every fact tied at the cut into
    the fusion, however many: short facts over a small vocabulary tie by the hundreds."""
    above, tied = at_cut(vec, top)
    need = top - len(above)
    if len(tied) > need:
        tied = np.asarray(heapq.nsmallest(need, tied.tolist(), key=ids.__getitem__), dtype=np.int64)
    return np.concatenate([above, tied])


class LexicalIndex:
    """Fact texts per scope; `search` ranks by BM25, best first, ties by id."""

    def __init__(self) -> None:
        self._scopes: dict[str, _Scope] = {}
        self._lock = threading.Lock()

    def add(self, scope_key: str, ids: Sequence[str], texts: Sequence[str],
            metadatas: Sequence[Mapping[str, Any] | None] | None = None) -> None:
        """Index texts under ids; an id already in the scope is replaced."""
        check_scope(scope_key)
        ids = check_ids(ids)
        if len(texts) != len(ids):
            raise ValueError(f"{len(ids)} ids, {len(texts)} texts")
        metas = check_metadatas(metadatas, len(ids))
        with self._lock:
            scope = self._scopes.setdefault(scope_key, _Scope())
            for fact_id, text, meta in zip(ids, texts, metas):
                scope.upsert(fact_id, text, meta)

    def remove(self, scope_key: str, fact_id: str) -> bool:
        with self._lock:
            scope = self._scopes.get(scope_key)
            if scope is None or not scope.remove(fact_id):
                return False
            if not len(scope):
                del self._scopes[scope_key]
            return True

    def remove_scope(self, scope_key: str) -> int:
        with self._lock:
            scope = self._scopes.pop(scope_key, None)
            return len(scope) if scope is not None else 0

    def count(self, scope_key: str) -> int:
        with self._lock:
            scope = self._scopes.get(scope_key)
            return len(scope) if scope is not None else 0

    def scores(self, scope_key: str, query: str, filters: Mapping[str, Any] | Filters | None = None,
               top: int | None = None, also: Iterable[str] = ()) -> dict[str, float]:
        """BM25 of the facts sharing a term with the query (the `top` best of them when given,
        ties at the cut going to the smaller ids, as `search` orders them), plus the score of
        each id in `also` (0 if it shares none)."""
        conditions = validate_filters(filters)
        with self._lock:
            scope = self._scopes.get(scope_key)
            if scope is None:
                return {}
            vec = scope.scores(terms(query))  # [rows]
            if conditions:
                rows = np.flatnonzero(vec > 0)
                match = matcher(conditions)
                keep = np.fromiter((match(scope.metas[r]) for r in rows), dtype=bool, count=len(rows))
                vec[rows[~keep]] = 0.0
            if top is not None and top < np.count_nonzero(vec):  # scores are never negative
                rows = _top_rows(vec, top, scope.ids)
            else:
                rows = np.flatnonzero(vec > 0)
            listed = rows.tolist()
            out = dict(zip([scope.ids[r] for r in listed], vec[rows].tolist()))
            extra = [i for i in also if i not in out and i in scope.rows]
            out.update(zip(extra, vec[[scope.rows[i] for i in extra]].tolist()))
        return out

    def search(self, scope_key: str, query: str, k: int,
               filters: Mapping[str, Any] | Filters | None = None) -> list[Hit]:
        """Top-k ids by BM25 of the query's terms (facts sharing none are not returned)."""
        scores = self.scores(scope_key, query, filters, top=k)
        best = sorted(scores.items(), key=lambda p: (-p[1], p[0]))[:k]
        return [Hit(fact_id, score) for fact_id, score in best]
