"""`GraphIndex`: the `VectorIndex` API over one Vamana graph per scope, for large scopes.

A scope's vectors live in a `VamanaGraph` (kvmem/index/vamana.py: batch-parallel inserts,
RaBitQ-guided walk re-ranked on stored rows, tombstones + consolidation). This module maps
string ids and metadata onto graph slots and decides, per search, between the graph and a full
scan: small scopes, and filters that leave too small a share of the scope, are scanned in full
(a walk that may return only a few of its visits cannot serve a 1% filter well). The scan
reads the graph's stored rows: with the default int8 rows (`GraphParams.vector_bits`) its
scores carry int8 rounding (about 1e-3), with 32 they are exact cosines.
Persistence is one .npz file per index, replaced atomically (kvmem/index/persist.py).
"""

from __future__ import annotations

import json
import math
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import date, datetime
from numbers import Integral
from typing import Any

import numpy as np

from kvmem.errors import IndexFileError, InvalidInputError
from kvmem.index.base import Hit, RowIds, VectorIndex, top_k
from kvmem.index.checks import check_ids, check_metadatas, check_scope, unit_query, unit_rows
from kvmem.index.filters import Filters, matcher, validate_filters
from kvmem.index.persist import atomic_write
from kvmem.index.remembered import RememberedFilters
from kvmem.index.rwlock import RWLock
from kvmem.index.vamana import GraphParams, VamanaGraph
from kvmem.index.vamana_kernels import score_slots

FORMAT = "kvmem-graph-index/2"  # 2 added int8 rows + scales
READABLE = (FORMAT, "kvmem-graph-index/1")


@dataclass(frozen=True)
class GraphIndexConfig:
    """When the graph serves a search, and how. Scans find every match; walks may miss some."""

    graph: GraphParams = field(default_factory=GraphParams)
    exact_below: int = 2_000  # scopes with fewer live vectors are scanned in full
    filter_exact_share: float = 0.2  # filters passing less than this share are scanned in full (at 100k,
    # 10% passing: scan 1,480 q/s recall 0.998 vs walk 470 q/s 0.889; 30%: walk 1,256 vs scan 438)
    max_filter_beam: int = 1_024  # a filtered walk widens its beam by 1/share up to this


class _Scope:
    """One scope: its graph plus the id and metadata of every slot."""

    def __init__(self, dim: int, params: GraphParams) -> None:
        self.graph = VamanaGraph(dim, params)
        self.ids: list[str | None] = []  # ids[slot]; None for a free or tombstoned slot
        self.metas: list[dict[str, Any] | None] = []  # metas[slot]
        self.rows: dict[str, int] = {}  # id -> slot
        self.filters = RememberedFilters()  # passing slots of recent filters, until the next write

    def __len__(self) -> int:
        return len(self.rows)

    def upsert(self, ids: list[str], rows: np.ndarray, metas: list[dict[str, Any]]) -> None:
        self.filters.invalidate()
        last = {id_: i for i, id_ in enumerate(ids)}  # a batch repeating an id keeps its last copy
        self.delete([id_ for id_ in last if id_ in self.rows])
        src = list(last.values())
        slots = self.graph.add(rows[src])  # [m]
        grow = self.graph.size - len(self.ids)
        self.ids.extend([None] * grow)
        self.metas.extend([None] * grow)
        for slot, (id_, i) in zip(slots.tolist(), last.items()):
            self.ids[slot], self.metas[slot], self.rows[id_] = id_, metas[i], slot

    def delete(self, ids: list[str]) -> None:
        self.filters.invalidate()
        slots = [self.rows.pop(id_) for id_ in ids]
        for slot in slots:
            self.ids[slot] = self.metas[slot] = None
        if slots:
            self.graph.delete(np.asarray(slots, np.int64))

    def live_slots(self) -> np.ndarray:
        return np.fromiter(self.rows.values(), np.int64, len(self.rows))

    def passing(self, conditions: Filters) -> np.ndarray:
        """Live slots [m] whose metadata satisfies `conditions` (remembered until the next write)."""
        match = matcher(conditions)
        return self.filters.passing(conditions, lambda: np.asarray(
            [s for s in self.live_slots().tolist() if match(self.metas[s])], np.int64))


class GraphIndex(VectorIndex):
    def __init__(self, dim: int, config: GraphIndexConfig | None = None) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise InvalidInputError(f"dim must be an int >= 1, got {dim!r}", param="dim")
        self.dim = dim
        self.config = config or GraphIndexConfig()
        self._scopes: dict[str, _Scope] = {}
        self._lock = RWLock()

    # -- writes -------------------------------------------------------------------------------

    def add(self, scope_key: str, ids: Sequence[str], vectors: np.ndarray,
            metadatas: Sequence[Mapping[str, Any] | None] | None = None) -> None:
        check_scope(scope_key)
        ids = check_ids(ids)
        rows = unit_rows(vectors, len(ids), self.dim)  # [n, dim]
        metas = check_metadatas(metadatas, len(ids))
        if not ids:
            return
        with self._lock.write():
            scope = self._scopes.get(scope_key)
            if scope is None:
                scope = self._scopes[scope_key] = _Scope(self.dim, self.config.graph)
            scope.upsert(ids, rows, metas)

    def remove(self, scope_key: str, id: str) -> bool:
        return self.delete(scope_key, [id]) == 1

    def delete(self, scope_key: str, ids: Sequence[str]) -> int:
        """Tombstone `ids` (unknown ones are skipped); returns how many were there."""
        check_scope(scope_key)
        ids = check_ids(ids)
        with self._lock.write():
            scope = self._scopes.get(scope_key)
            if scope is None:
                return 0
            known = list(dict.fromkeys(i for i in ids if i in scope.rows))
            scope.delete(known)
            if not scope:
                del self._scopes[scope_key]
            return len(known)

    def remove_scope(self, scope_key: str) -> int:
        check_scope(scope_key)
        with self._lock.write():
            scope = self._scopes.pop(scope_key, None)
            return len(scope) if scope is not None else 0

    # -- reads --------------------------------------------------------------------------------

    def search(self, scope_key: str, query: np.ndarray, k: int,
               filters: Mapping[str, Any] | Filters | None = None) -> list[Hit]:
        if isinstance(k, bool) or not isinstance(k, Integral) or k < 1:
            raise InvalidInputError(f"k must be an int >= 1, got {k!r}", param="k")
        check_scope(scope_key)
        q = unit_query(query, self.dim)  # [dim]
        conditions = validate_filters(filters)
        with self._lock.read():
            scope = self._scopes.get(scope_key)
            if scope is None:
                return []
            return self._search_scope(scope, q, int(k), conditions)

    def _search_scope(self, scope: _Scope, q: np.ndarray, k: int, conditions: Filters) -> list[Hit]:
        cfg = self.config
        if not conditions:
            if len(scope) < cfg.exact_below:
                return _scan(scope, scope.live_slots(), q, k)
            slots, scores = scope.graph.search(q, k)
            return _hits(scope, slots, scores, k)
        passed = scope.passing(conditions)  # [m]
        share = len(passed) / max(1, len(scope))
        if len(passed) < cfg.exact_below or share < cfg.filter_exact_share:
            return _scan(scope, passed, q, k)
        blocked = np.ones(len(scope.graph.deleted), np.uint8)  # [cap]; 0 = may be returned
        blocked[passed] = 0
        beam = min(cfg.max_filter_beam, math.ceil(scope.graph.default_beam() / share))
        slots, scores = scope.graph.search(q, k, beam=max(beam, k), blocked=blocked)
        if len(slots) < min(k, len(passed)):
            return _scan(scope, passed, q, k)  # the walk saw too few that pass: scan them all
        return _hits(scope, slots, scores, k)

    def similarities(self, scope_key: str, query: np.ndarray, ids: Sequence[str]) -> dict[str, float]:
        """Cosine of `query` [dim] with each of `ids` in the scope (ids not there are left out)."""
        check_scope(scope_key)
        q = unit_query(query, self.dim)  # [dim]
        with self._lock.read():
            scope = self._scopes.get(scope_key)
            if scope is None:
                return {}
            found = [i for i in ids if i in scope.rows]
            slots = [scope.rows[i] for i in found]
            return dict(zip(found, (scope.graph.rows(slots) @ q).tolist()))  # [m, dim] @ [dim] -> [m]

    def export(self, scope_key: str) -> tuple[list[str], np.ndarray, list[dict[str, Any]]]:
        """The scope's live ids, unit vectors [n, dim] and metadata (to move it to another index)."""
        with self._lock.read():
            scope = self._scopes.get(scope_key)
            if scope is None:
                return [], np.empty((0, self.dim), np.float32), []
            slots = scope.live_slots()
            return ([scope.ids[s] for s in slots.tolist()], scope.graph.rows(slots),
                    [dict(scope.metas[s] or {}) for s in slots.tolist()])

    def count(self, scope_key: str) -> int:
        with self._lock.read():
            scope = self._scopes.get(scope_key)
            return len(scope) if scope is not None else 0

    def __len__(self) -> int:
        with self._lock.read():
            return sum(len(s) for s in self._scopes.values())

    def graph(self, scope_key: str) -> VamanaGraph | None:
        """The scope's graph, for benchmarks and inspection (do not write to it)."""
        scope = self._scopes.get(scope_key)
        return scope.graph if scope is not None else None

    # -- persistence --------------------------------------------------------------------------

    def save(self, path) -> None:
        """Write the whole index to `path` atomically: a crash leaves the previous file intact."""
        with self._lock.read():
            header = {"format": FORMAT, "dim": self.dim, "config": _config_dict(self.config), "scopes": []}
            arrays: dict[str, np.ndarray] = {}
            for i, (key, scope) in enumerate(self._scopes.items()):
                header["scopes"].append({"key": key, "ids": scope.ids, "metas": [_encode_meta(m) for m in scope.metas]})
                arrays.update({f"s{i}_{name}": a for name, a in scope.graph.state().items()})
            arrays["header"] = np.frombuffer(json.dumps(header, default=_json_scalar).encode(), np.uint8)
            atomic_write(path, lambda f: np.savez(f, **arrays))

    @classmethod
    def load(cls, path) -> "GraphIndex":
        """Read an index written by `save`; raises IndexFileError when the file is not one."""
        try:
            with np.load(path, allow_pickle=False) as z:
                header = json.loads(z["header"].tobytes())
                if header.get("format") not in READABLE:
                    raise IndexFileError(f"{path}: not a {FORMAT} file")
                config = _config_from(header["config"])
                index = cls(int(header["dim"]), config)
                for i, spec in enumerate(header["scopes"]):
                    names = ("vectors", "scales", "codes", "factors", "adj", "deg", "deleted", "free", "meta",
                             "signs", "centroid")
                    state = {n: z[f"s{i}_{n}"] for n in names if f"s{i}_{n}" in z}  # format 1 has no scales
                    index._scopes[spec["key"]] = _restore_scope(spec, state, config.graph)
        except (OSError, ValueError, KeyError, EOFError, TypeError, zipfile.BadZipFile) as e:
            raise IndexFileError(f"cannot read graph index {path}: {e}") from e
        return index


def _restore_scope(spec: dict, state: dict[str, np.ndarray], params: GraphParams) -> _Scope:
    scope = _Scope(int(state["meta"][0]), params)
    scope.graph = VamanaGraph.from_state(state, params)
    scope.ids = list(spec["ids"])
    scope.metas = [_decode_meta(m) for m in spec["metas"]]
    scope.rows = {id_: slot for slot, id_ in enumerate(scope.ids) if id_ is not None}
    return scope


def _scan(scope: _Scope, slots: np.ndarray, q: np.ndarray, k: int) -> list[Hit]:
    """Top-k over `slots` [m] by their stored rows, scored in place (no decoded copy, no id list)."""
    if len(slots) == 0:
        return []
    g = scope.graph
    scores = score_slots(g.vectors, g.scales, slots, q)  # [m]
    return top_k(scores, RowIds(scope.ids, slots), k)


def _hits(scope: _Scope, slots: np.ndarray, scores: np.ndarray, k: int) -> list[Hit]:
    pairs = sorted(zip(scores.tolist(), slots.tolist()), key=lambda p: (-p[0], scope.ids[p[1]]))
    return [Hit(scope.ids[s], score) for score, s in pairs[:k]]


def _config_dict(config: GraphIndexConfig) -> dict:
    return asdict(config)


def _config_from(raw: dict) -> GraphIndexConfig:
    graph = GraphParams(**raw.pop("graph"))
    return GraphIndexConfig(graph=graph, **raw)


def _json_scalar(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()  # numpy numbers pass the filters' checks; JSON wants Python ones
    raise InvalidInputError(f"metadata value {value!r} cannot be saved", param="metadata")


def _encode_meta(meta: dict[str, Any] | None) -> dict | None:
    """JSON for metadata; dates are tagged so they load back as dates, not strings."""
    if meta is None:
        return None
    out = {}
    for key, value in meta.items():
        if isinstance(value, datetime):
            value = {"$datetime": value.isoformat()}
        elif isinstance(value, date):
            value = {"$date": value.isoformat()}
        out[key] = value
    return out


def _decode_meta(meta: dict | None) -> dict[str, Any] | None:
    if meta is None:
        return None
    out = {}
    for key, value in meta.items():
        if isinstance(value, dict) and "$datetime" in value:
            value = datetime.fromisoformat(value["$datetime"])
        elif isinstance(value, dict) and "$date" in value:
            value = date.fromisoformat(value["$date"])
        out[key] = value
    return out
