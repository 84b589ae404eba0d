"""The memory service: Mem0's API shape, with retrieved facts injected as KV.

    with KVMem() as mem:                                   # bundled SmolLM2 on vLLM
        mem.add([{"role": "user", "content": "My sister adopted a puppy."},
                 {"role": "user", "content": "She named it Bruno."}], user_id="alice")
        mem.search("What is the puppy called?", user_id="alice", k=3)
        r = mem.chat("What is my sister's puppy called?", user_id="alice", k=5, mode="kv")

Facts live in SQLite, or PostgreSQL when several gateways share them (text, metadata, history,
vectors), vectors also in in-memory indexes per user, KV blobs on disk (and in a shared Redis tier
when configured). With PostgreSQL, every process keeps its indexes in step with the others'
writes through the store's change feed (`_on_fact_change`). Writes store and index first, then
encode; a fact without usable KV is served by text prefill and re-encoded in the background. With a disk budget or a per-user quota
(KVConfig), the least-used blobs are evicted (kv/budget.py): their facts are served by text and
come back when chats use them enough.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import datetime
from collections import Counter
from dataclasses import replace
from typing import Iterator

from tqdm import tqdm

from kvmem.config import RETRIEVAL_MODES, Config, KVConfig
from kvmem.embed.fact import fact_vectors
from kvmem.encoding import EncodeReport, Encoder, salt
from kvmem.errors import EngineError, InvalidInputError, UnknownFactError
from kvmem.facts.messages import check_messages, dated, turn_facts
from kvmem.facts.scope import Scope
from kvmem.facts import open_fact_store
from kvmem.facts.store import MAX_LIMIT, FactRecord, HistoryEvent
from kvmem.facts.text import check_fact_text, check_nested, check_unicode, search_text
from kvmem.index import Hit, validate_filters
from kvmem.index import fusion
from kvmem.index.lexical import LexicalIndex
from kvmem.index.tiered import TieredIndex
from kvmem.kv.budget import DiskBudget
from kvmem.kv.store import KVStore
from kvmem.model import resolve_model
from kvmem.results import AddResult, ChatResult, SearchHit

log = logging.getLogger(__name__)
MODES = ("kv", "text", "off")
ENCODE_MODES = ("sync", "background", "none")


class KVMem:
    def __init__(self, config: Config | None = None, *, engine=None, start_engine: bool = True,
                 embedder=None, background: bool = True) -> None:
        from transformers import AutoTokenizer

        from kvmem.embed import default_embedder
        from kvmem.engine.prompt import PromptBuilder

        self.config = config or Config.from_env()
        self.model = resolve_model(self.config.engine.model, self.config.models_dir, self.config.engine.dtype)
        self.prompts = PromptBuilder(AutoTokenizer.from_pretrained(str(self.model.path)), self.config.prompt)
        self.kv = KVStore(self.config.kv_dir, self.model.fingerprint, self.config.kv.hot_cache_mib << 20,
                          shared_url=self.config.kv.shared_url)
        self.facts = open_fact_store(self.config.database_url, self.config.home / "facts.sqlite")
        self.embedder = embedder or default_embedder()
        self.budget = self._new_budget()
        self._write_lock = threading.RLock()  # keeps store, index and blobs in step
        self.stats: Counter[str] = Counter()  # chats per mode, fallbacks, tier hits, evictions
        with self._write_lock:
            # Other processes' writes (PostgreSQL; SQLite has one owner) are heard from before the
            # indexes are read from the store, and applied after (the lock holds them back), so
            # none made meanwhile is missed.
            self._unsubscribe = self.facts.subscribe(self._on_fact_change)
            self.index, self.lexical = self._build_indexes()
        self._owns_engine = engine is None and start_engine
        self.engine = engine if engine is not None else (self._start_engine() if start_engine else None)
        # Behind replicas this process only checks that a blob is stored (a header, or the shared
        # tier's stamp) rather than reading it whole: it never injects, the replica verifies.
        self.encoder = Encoder(self.engine, self.prompts, self.kv, self.facts, on_encoded=self._admit,
                               verify_blobs=not self.config.engine.url) if self.engine else None
        if self.encoder:
            self.budget.remember(self.facts.usage())
            self._check_blobs()
            if background:
                self.encoder.start()

    def _all_records(self):
        offset = 0
        while page := self.facts.list(limit=MAX_LIMIT, offset=offset):
            yield from page
            offset += len(page)

    def _start_engine(self):
        if self.config.engine.url:  # a replica serves (kvmem replica); no vLLM in this process
            from kvmem.engine.remote import RemoteEngine

            return RemoteEngine(self.config.engine.url, self.model, self.kv,
                                use_reader=self.config.kv.reader_adapter != "off")
        from kvmem.engine.llm import Engine

        return Engine(self.model, self.config)

    def _build_indexes(self) -> tuple[TieredIndex, LexicalIndex]:
        """Dense and lexical indexes of every stored fact (built aside, so searches meanwhile
        keep using the old ones)."""
        index, lexical = TieredIndex(self.embedder.dim), LexicalIndex()  # exact scan; graph past 20k facts
        # From the embeddings rows alone: one SQL read per fact made start-up O(n) round trips.
        for fact_id, scope_key, vector, metadata in self.facts.embeddings():
            scope = Scope.from_key(scope_key)
            index.add(scope.user_id, [fact_id], vector[None, :], [_index_metadata(scope, metadata)])
        for fact_id, scope_key, text, context, origin, metadata in self.facts.texts():
            scope = Scope.from_key(scope_key)
            lexical.add(scope.user_id, [fact_id], [search_text(text, context, origin)],
                        [_index_metadata(scope, metadata)])
        return index, lexical

    def _on_fact_change(self, change: dict) -> None:
        """A committed write to the shared fact store, by this process or another (the store's
        listener thread). Each change is applied by reading the fact as it is now, so late,
        repeated or reordered notifications all converge on the store's state."""
        op, fact_id = change.get("op"), change.get("id")
        if op in ("reset", "resync"):
            with self._write_lock:
                self.index, self.lexical = self._build_indexes()
            return
        try:
            record = self.facts.get(fact_id)
        except UnknownFactError:  # deleted (now or since): gone from the indexes too
            user = change.get("user_id")
            if user:
                with self._write_lock:
                    self._unindex(user, fact_id)
            return
        with self._write_lock:
            if record.embedding is not None:
                self._index(record, record.embedding)
            else:  # its text changed and the new vector is not stored yet: found by words only
                self.index.remove(record.scope.user_id, record.id)
                self.lexical.add(record.scope.user_id, [record.id],
                                 [search_text(record.text, record.context, record.origin)],
                                 [_index_metadata(record.scope, record.metadata)])

    def _new_budget(self) -> DiskBudget:
        kv = self.config.kv
        return DiskBudget(KVConfig.mib_to_bytes(kv.disk_budget_mib), KVConfig.mib_to_bytes(kv.tenant_quota_mib))

    def _check_blobs(self) -> None:
        """At start-up, facts marked encoded whose blob is gone, truncated or another fact's
        (a header check, no checksum) become pending, so kv_status tells the truth; the intact
        ones are counted against the disk budget (evicted now if it shrank)."""
        for record in self._all_records():
            if record.kv_status == "encoded":
                if self.kv.intact(record.id):
                    self._admit(record)
                else:
                    self.facts.set_kv_status(record.id, "pending")

    def _admit(self, record: FactRecord) -> None:
        """A blob was written for this fact: count it, and evict what the budget no longer holds."""
        stamp = self.kv.stamp(record.id)
        if stamp is None:
            return
        for victim in self.budget.admit(record.id, record.scope.user_id, stamp[1]):
            self._evict(victim)

    def _evict(self, fact_id: str) -> None:
        with self._write_lock:
            self.kv.delete(fact_id)
            try:
                self.facts.set_kv_status(fact_id, "evicted")
            except UnknownFactError:  # deleted meanwhile
                pass
        self.stats["kv_evictions"] += 1

    # -- write path -----------------------------------------------------------------------------

    def add(self, messages: str | list[dict] | None = None, *, user_id: str, agent_id: str | None = None,
            run_id: str | None = None, facts: list[str] | None = None, metadata: dict | None = None,
            context: str = "", window: int | None = None, encode: str = "sync",
            timestamp: str | datetime | None = None, origin: str = "") -> AddResult:
        """Store facts (`facts=[...]`, or a str) or a conversation (a list of messages, one fact per turn).

        `timestamp` (facts only; messages carry their own): when the facts held or were said. It
        is shown in front of each fact as a turn's is ("[9 May 2023] ..."), kept in the metadata,
        and an ISO one becomes the facts' event_time. `context` (facts only): text each fact's KV is
        encoded after, and searched with. `origin` (facts only): the message the facts were drawn
        from; searched with them, never encoded or shown (on LoCoMo observations, recall@10 0.659
        -> 0.695, while encoding after the message cost KV-mode log-likelihood)."""
        scope = Scope(user_id, agent_id, run_id)
        if encode not in ENCODE_MODES:
            raise InvalidInputError(f"encode must be one of {ENCODE_MODES}, got {encode!r}")
        items = self._items(messages, facts, context, window, metadata, timestamp, origin)
        vectors = fact_vectors(self.embedder, [i["text"] for i in items], [i["context"] for i in items],
                               [i.get("origin", "") for i in items])  # [n, dim]
        with self._write_lock:
            pairs = self.facts.add_many([dict(i, scope=scope, embedding=v) for i, v in zip(items, vectors)])
            new = [r for r, created in pairs if created]
            for r in new:
                self._index(r, r.embedding)
        report = self._encode_now(new, encode)
        return AddResult(tuple(r.id for r, _ in pairs), len(new), len(pairs) - len(new), report)

    def _items(self, messages, facts, context, window, metadata, timestamp, origin) -> list[dict]:
        if (messages is None) == (facts is None):
            raise InvalidInputError("pass either messages (a conversation or one fact string) or facts=[...]")
        if isinstance(messages, str):
            facts, messages = [messages], None
        if not isinstance(origin, str):
            raise InvalidInputError(f"origin must be a string, got {type(origin).__name__}")
        check_unicode("origin", origin)
        if origin and facts is None:
            raise InvalidInputError("origin applies to facts; a conversation's turns are their own origin")
        stamp = _timestamp(timestamp)
        if facts is not None:
            if not isinstance(facts, list) or not facts:
                raise InvalidInputError("facts must be a non-empty list of strings")
            items = [{"text": self._checked_text(dated(check_fact_text(t).strip(), stamp), context),
                      "context": context or "", "origin": origin, "source": "fact", "event_time": _iso_or_none(stamp),
                      "metadata": _with_timestamp(metadata, stamp)} for t in facts]
        elif stamp is not None:
            raise InvalidInputError("timestamp applies to facts; give each message its own timestamp")
        else:
            check_messages(messages)
            turns = turn_facts(messages, self.config.memory.window if window is None else window,
                               self.config.prompt.fact_template)
            items = [{"text": self._checked_text(t.text, t.context), "context": t.context, "source": "messages",
                      "position": t.position, "event_time": _iso_or_none(t.timestamp),
                      "metadata": _with_timestamp(metadata, t.timestamp)} for t in turns]
        return items

    def _checked_text(self, text, context: str) -> str:
        if not isinstance(context, str):
            raise InvalidInputError(f"context must be a string, got {type(context).__name__}")
        check_unicode("context", context)
        check_fact_text(text)
        limit = self.config.memory.max_fact_tokens
        if len(text) > limit * self.prompts.max_token_chars:  # refused before spending time tokenizing it
            raise InvalidInputError(f"fact is {len(text)} characters long; the limit is {limit} tokens "
                                    "(memory.max_fact_tokens)")
        tokens = self.prompts.fact_tokens(text)
        if len(tokens) > limit:
            raise InvalidInputError(f"fact is {len(tokens)} tokens long; the limit is {limit} (memory.max_fact_tokens)")
        if len(self.prompts.head_ids) + len(self.prompts.context_tokens(context)) + len(tokens) >= self.config.engine.max_model_len:
            raise InvalidInputError("fact and its context do not fit the model's context length")
        return text.strip()

    def _encode_now(self, records: list[FactRecord], mode: str) -> EncodeReport | None:
        if not records or mode == "none" or self.encoder is None:
            return None
        if mode == "background":
            self.encoder.kick()
            return None
        return self.encoder.encode(records)

    def _index(self, record: FactRecord, vector) -> None:
        """Both indexes, in step (caller holds the write lock)."""
        meta = [_index_metadata(record.scope, record.metadata)]
        self.index.add(record.scope.user_id, [record.id], vector[None, :], meta)
        self.lexical.add(record.scope.user_id, [record.id], [search_text(record.text, record.context, record.origin)],
                         meta)

    def encode_pending(self, timeout: float = 600.0) -> bool:
        """Block until the background encoder has nothing left to do."""
        return self._need_encoder().wait_idle(timeout)

    def update(self, fact_id: str, text: str, metadata: dict | None = None) -> FactRecord:
        """New text: re-embedded, re-indexed and re-encoded (the old KV is dropped at once)."""
        old = self.facts.get(fact_id)
        self._checked_text(text, old.context)
        vector = fact_vectors(self.embedder, [text.strip()], [old.context], [old.origin])[0]
        with self._write_lock:
            record = self.facts.update(fact_id, text.strip(), metadata=metadata, embedding=vector)
            if record.text != old.text:
                self.kv.delete(fact_id)  # the old KV must never serve the new text
                self.budget.forget(fact_id)
            self._index(record, vector)
        if record.text != old.text:
            self._encode_now([record], "sync")
        return self.facts.get(fact_id)

    def reembed(self, *, user_id: str | None = None, batch: int = 256, progress: bool = False) -> int:
        """Recompute every stored fact's search vector (one user's with `user_id`) the way `add`
        makes it now (kvmem.embed.fact) and re-index it; returns how many were rewritten.

        A home keeps the vectors it was written with: after an upgrade that changes how they are
        made, its facts rank as before until this runs. Each batch is written on its own, so an
        interrupted run loses nothing and a rerun redoes it; a fact whose text changes meanwhile
        keeps the vector its update made (the write is skipped)."""
        if user_id is not None:
            Scope(user_id)
        if not _int_at_least(batch, 1):
            raise InvalidInputError(f"batch must be an int >= 1, got {batch!r}")
        total = self.facts.count(user_id=user_id) if progress else None
        done = offset = 0
        with tqdm(total=total, desc="re-embedding facts", unit="fact", disable=not progress) as bar:
            while page := self.facts.list(user_id=user_id, limit=min(batch, MAX_LIMIT), offset=offset):
                vectors = fact_vectors(self.embedder, [r.text for r in page], [r.context for r in page],
                                       [r.origin for r in page])  # [n, dim]
                with self._write_lock:
                    for record, vector in zip(page, vectors):
                        try:
                            if not self.facts.set_embedding(record.id, vector, if_text=record.text):
                                continue  # updated meanwhile: its update stored a vector of its own
                        except UnknownFactError:
                            continue  # deleted meanwhile
                        self._index(self.facts.get(record.id), vector)
                        done += 1
                offset += len(page)
                bar.update(len(page))
        return done

    def delete(self, fact_id: str) -> None:
        """Forget: the text, the vector and the KV blob are gone; the history keeps the event only."""
        with self._write_lock:
            record = self.facts.delete(fact_id)
            self._unindex(record.scope.user_id, fact_id)
            self.kv.delete(fact_id)

    def delete_all(self, *, user_id: str, agent_id: str | None = None, run_id: str | None = None) -> int:
        scope = Scope(user_id, agent_id, run_id)
        with self._write_lock:
            ids = self.facts.delete_scope(scope)
            for fact_id in ids:
                self._unindex(user_id, fact_id)
                self.kv.delete(fact_id)
        return len(ids)

    def _unindex(self, user_id: str, fact_id: str) -> None:
        """Drop a forgotten fact from the vector and word indexes and the disk budget (write lock held)."""
        self.index.remove(user_id, fact_id)
        self.lexical.remove(user_id, fact_id)
        self.budget.forget(fact_id)

    def reset(self) -> None:
        """Forget everything: every user's facts, vectors, history and blobs."""
        with self._write_lock:
            for record in self._all_records():
                self.kv.delete(record.id)
            self.facts.reset()
            self.index, self.lexical = self._build_indexes()  # empty now
            self.budget = self._new_budget()

    # -- read path ------------------------------------------------------------------------------

    def get(self, fact_id: str) -> FactRecord:
        return self.facts.get(fact_id)

    def get_all(self, *, user_id: str, agent_id: str | None = None, run_id: str | None = None,
                filters: dict | None = None, limit: int = 100, offset: int = 0) -> list[FactRecord]:
        from kvmem.index import matches

        Scope(user_id, agent_id, run_id)
        check_nested("filters", filters)
        norm = validate_filters(filters) if filters else None
        where = (lambda md: matches(md, norm)) if norm else None
        return self.facts.list(user_id=user_id, agent_id=agent_id, run_id=run_id, limit=limit, offset=offset, where=where)

    def history(self, fact_id: str) -> list[HistoryEvent]:
        return self.facts.history(fact_id)

    def search(self, query: str, *, user_id: str, agent_id: str | None = None, run_id: str | None = None,
               k: int = 10, filters: dict | None = None, ranking: str | None = None) -> list[SearchHit]:
        """The scope's top-k facts for `query`; `ranking` ("hybrid", "dense", "lexical") overrides
        the configured RetrievalConfig.mode for this call."""
        Scope(user_id, agent_id, run_id)
        if not _int_at_least(k, 1):
            raise InvalidInputError(f"k must be an int >= 1, got {k!r}")
        if ranking is not None and ranking not in RETRIEVAL_MODES:
            raise InvalidInputError(f"ranking must be one of {RETRIEVAL_MODES}, got {ranking!r}")
        if not isinstance(query, str) or not query.strip():
            raise InvalidInputError("query must be a non-empty string")
        check_unicode("query", query)
        check_nested("filters", filters)
        validate_filters(filters or {})  # the user's own filters, checked before scope keys join them
        conditions = {**(filters or {}), **{k_: v for k_, v in (("_agent_id", agent_id), ("_run_id", run_id)) if v}}
        hits = self._rank(user_id, query, k, validate_filters(conditions) if conditions else None,
                          ranking or self.config.retrieval.mode)
        records = [(h, self.facts.get(h.id)) for h in hits]
        return [SearchHit(r.id, r.text, float(h.score), r.metadata, r.created_at, r.kv_status) for h, r in records]

    def _rank(self, user_id: str, query: str, k: int, conditions, mode: str) -> list[Hit]:
        r = self.config.retrieval
        if mode == "lexical":
            return self.lexical.search(user_id, query, k, conditions)
        vector = self.embedder.embed([query])[0]
        if mode == "dense":
            return self.index.search(user_id, vector, k, conditions)
        return fusion.hybrid_search(self.index, self.lexical, user_id, vector, query, k, conditions,
                                    r.depth, r.dense_weight)

    def chat(self, messages: str | list[dict], *, user_id: str, agent_id: str | None = None,
             run_id: str | None = None, k: int = 10, filters: dict | None = None, fact_ids: list[str] | None = None,
             mode: str = "kv", max_tokens: int = 64, logprobs: int | None = 20,
             cancel: threading.Event | None = None, reader: bool = True,
             text_facts: int | None = None) -> ChatResult:
        """Answer the conversation with the user's top-k facts for its last user message.

        Facts go into the prompt in the order they were stored (conversation order), not by
        score: a turn was encoded after the turns that preceded it, so keeping that order keeps
        the prompt closest to what each fact's KV was computed with, and helps questions about
        time. In KV mode, facts without a blob (pending, failed, evicted) go after those with
        one: the engine can only be handed a prefix of the prompt, so one such fact early on
        would turn every later fact into text too. `fact_ids` skips retrieval and uses exactly
        those facts, in that order.
        Thread-safe: concurrent chats are batched by the engine. Setting `cancel` (from another
        thread) aborts the generation and raises RequestCancelled. KV mode reads with the reader
        adapter when the engine has one; `reader=False` reads without it (for measuring it).
        `text_facts`: how many of the last facts KV mode prefills as text (None: kv.text_facts).
        """
        facts, request, retrieval_s = self._prepare(messages, user_id, agent_id, run_id, k, filters, fact_ids,
                                                    mode, max_tokens, logprobs, text_facts)
        request = replace(request, reader=request.reader and reader)
        (result,) = self._need_engine().run([request], cancel=cancel)
        return self._finish(result, facts, mode, user_id, retrieval_s)

    def chat_stream(self, messages: str | list[dict], *, user_id: str, agent_id: str | None = None,
                    run_id: str | None = None, k: int = 10, filters: dict | None = None,
                    fact_ids: list[str] | None = None, mode: str = "kv", max_tokens: int = 64,
                    logprobs: int | None = None, cancel: threading.Event | None = None,
                    text_facts: int | None = None) -> Iterator[str | ChatResult]:
        """Like chat, streaming: yields text deltas as they are generated, then the ChatResult.

        Closing the generator early, or setting `cancel`, aborts the generation.
        """
        facts, request, retrieval_s = self._prepare(messages, user_id, agent_id, run_id, k, filters, fact_ids,
                                                    mode, max_tokens, logprobs, text_facts)
        for item in self._need_engine().stream(request, cancel=cancel):
            yield item if isinstance(item, str) else self._finish(item, facts, mode, user_id, retrieval_s)

    def score(self, messages: str | list[dict], answer: str, *, user_id: str, fact_ids: list[str],
              mode: str = "kv", reader: bool = True) -> list[float]:
        """Teacher forcing: the logprob of each token of `answer` as the reply, with these facts
        (read as `chat` reads them, `reader` included)."""
        if not isinstance(answer, str) or not answer.strip():
            raise InvalidInputError("answer must be a non-empty string")
        check_unicode("answer", answer)
        facts, request, _ = self._prepare(messages, user_id, None, None, 1, None, fact_ids, mode, 1, None)
        answer_ids = tuple(self.prompts.context_tokens(answer.strip()))
        # A salt of its own: a cached block must never cover the answer, whose positions would then
        # carry no logprobs. Injection does not depend on the salt, so kv mode still injects.
        scored = replace(request, token_ids=request.token_ids + answer_ids, score_last=len(answer_ids),
                         salt=f"{request.salt}:score:{uuid.uuid4().hex}", reader=request.reader and reader)
        (result,) = self._need_engine().run([scored])
        self._finish(result, facts, mode, user_id, 0.0)
        return list(result.scored)

    def _prepare(self, messages, user_id, agent_id, run_id, k, filters, fact_ids, mode, max_tokens, logprobs,
                 text_facts=None):
        from kvmem.engine.llm import EngineRequest
        from kvmem.connector.plan import INJECT, Plan

        if mode not in MODES:
            raise InvalidInputError(f"mode must be one of {MODES}, got {mode!r}")
        if not _int_at_least(max_tokens, 1):
            raise InvalidInputError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if logprobs is not None and not _int_at_least(logprobs, 0):
            raise InvalidInputError(f"logprobs must be None or an int >= 0, got {logprobs!r}")
        if text_facts is not None and not _int_at_least(text_facts, 0):
            raise InvalidInputError(f"text_facts must be None or an int >= 0, got {text_facts!r}")
        messages = [{"role": "user", "content": messages}] if isinstance(messages, str) else messages
        check_messages(messages)
        self._check_fits(messages)
        t0 = time.perf_counter()
        facts = self._chat_facts(messages, user_id, agent_id, run_id, k, filters, fact_ids, mode)
        retrieval_s = time.perf_counter() - t0
        self._need_engine()
        if mode == "kv":
            self.encoder.ensure_head()
        tokens = self.prompts.fact_tokens_many([f.text for f in facts])
        prompt = self.prompts.chat([(f.id, t) for f, t in zip(facts, tokens)], messages)
        if len(prompt.token_ids) + max_tokens > self.config.engine.max_model_len:
            raise InvalidInputError(f"prompt of {len(prompt.token_ids)} tokens + {max_tokens} new tokens "
                                    f"exceeds the model's {self.config.engine.max_model_len}")
        # The facts start after the head: where the reader's KV map begins (sent only when reading with it).
        text_facts = self.config.kv.text_facts if text_facts is None else text_facts
        plan = Plan(INJECT, _injected(prompt.segments, text_facts),
                    map_from=len(self.prompts.head_ids)) if mode == "kv" else None
        # Only KV-mode chats read with the reader adapter; text mode and encoding never do.
        request = EngineRequest(prompt.token_ids, salt(mode, user_id), max_tokens, plan, logprobs, reader=mode == "kv",
                                route=user_id)
        return facts, request, retrieval_s

    def _check_fits(self, messages: list[dict]) -> None:
        """Refuse a conversation too long to fit before tokenizing it (megabytes take seconds)."""
        chars = sum(len(m["content"]) for m in messages)
        bound = self.config.engine.max_model_len * self.prompts.max_token_chars  # no token is longer
        if chars > bound:
            raise InvalidInputError(f"messages of {chars} characters (at least {-(-chars // self.prompts.max_token_chars)}"
                                    f" tokens) exceed the model's {self.config.engine.max_model_len}")

    def _chat_facts(self, messages, user_id, agent_id, run_id, k, filters, fact_ids, mode) -> list[FactRecord]:
        Scope(user_id, agent_id, run_id)
        if mode == "off":
            return []
        if fact_ids is not None:
            if not isinstance(fact_ids, (list, tuple)):
                raise InvalidInputError(f"fact_ids must be a list of fact ids, got {type(fact_ids).__name__}")
            facts = [self.facts.get(i) for i in fact_ids]
            foreign = [f.id for f in facts if f.scope.user_id != user_id]
            if foreign:
                raise InvalidInputError(f"facts {foreign} do not belong to user {user_id!r}")
            return facts
        question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        if not question.strip():
            return []
        hits = self.search(question, user_id=user_id, agent_id=agent_id, run_id=run_id, k=k, filters=filters)
        facts = [self.facts.get(h.id) for h in hits]
        facts.sort(key=lambda f: (f.created_at, f.position or 0, f.id))
        return kv_first(facts) if mode == "kv" else facts

    def _finish(self, r, facts, mode: str, user_id: str, retrieval_s: float) -> ChatResult:
        c = r.connector
        reasons = c.get("fallbacks", {})
        self.stats[f"chat_{mode}"] += 1
        self.stats["fallbacks"] += c.get("facts_as_text", 0)
        if mode == "kv":
            self.budget.touch(f.id for f in facts)
            from_blobs = max(0, c.get("injected_facts", 0) - 1)  # the first segment is the system header
            self.stats["kv_disk_hits"] += from_blobs
            self.stats["kv_disk_misses"] += len(facts) - from_blobs
            totals = c.get("tier_totals", {})  # the engine's worker, since it started: keep the newest
            self.stats["kv_ram_hits"] = max(self.stats["kv_ram_hits"], totals.get("ram_hits", 0))
            self.stats["kv_ram_misses"] = max(self.stats["kv_ram_misses"], totals.get("disk_loads", 0))
        self._requeue(reasons)
        return ChatResult(
            answer=r.text.strip(), mode=mode, fact_ids=tuple(f.id for f in facts), ttft_s=r.ttft_s,
            latency_s=r.latency_s, prompt_tokens=r.prompt_tokens, injected_tokens=c.get("claimed_tokens", 0),
            cached_tokens=r.cached_tokens - c.get("claimed_tokens", 0), fallbacks=c.get("facts_as_text", 0),
            fallback_reasons=reasons, retrieval_s=retrieval_s, token_ids=r.token_ids, first_logprobs=r.first_logprobs,
            reader_adapter=r.adapter,
        )

    def _requeue(self, reasons: dict[str, str]) -> None:
        """A blob that failed at serving time gets re-encoded in the background; an evicted one
        only once chats have used it more than the least-used blob that it would displace."""
        requeued = False
        for fact_id in reasons:
            if not fact_id.startswith("f-"):
                continue
            try:
                record = self.facts.get(fact_id)
                if record.kv_status == "evicted":
                    if not self.budget.worth_readmitting(fact_id, record.scope.user_id):
                        continue
                    self.stats["kv_readmissions"] += 1
                self.facts.set_kv_status(fact_id, "pending")
                requeued = True
            except UnknownFactError:  # deleted meanwhile: nothing to re-encode
                pass
        if requeued:
            self.encoder.kick()

    def kv_tiers(self) -> dict[str, int | None]:
        """The KV tiers at a glance: bytes and budgets, hits and misses, evictions and re-encodes
        of evicted facts. Disk: facts of KV-mode chats served from a blob or as text, since this
        KVMem was opened. RAM: blob loads of the engine's worker served from its RAM tier or read
        from disk, since the engine started (as of the last chat)."""
        s = self.stats
        return {"ram_budget_bytes": self.config.kv.hot_cache_mib << 20, "disk_bytes": self.budget.used, "disk_budget_bytes": self.budget.budget,
                "tenant_quota_bytes": self.budget.quota, "disk_blobs": len(self.budget),
                "disk_hits": s["kv_disk_hits"], "disk_misses": s["kv_disk_misses"],
                "ram_hits": s["kv_ram_hits"], "ram_misses": s["kv_ram_misses"],
                "evictions": s["kv_evictions"], "readmissions": s["kv_readmissions"]}

    # -- lifecycle ------------------------------------------------------------------------------

    def _need_engine(self):
        if self.engine is None:
            raise EngineError("this KVMem was opened without an engine (start_engine=False)")
        return self.engine

    def _need_encoder(self) -> Encoder:
        self._need_engine()
        return self.encoder

    def close(self) -> None:
        self._unsubscribe()
        if self.encoder is not None:
            self.encoder.stop()
            self.facts.save_usage(self.budget.changed_hits())  # the eviction order survives a restart
        if self._owns_engine and self.engine is not None:
            self.engine.close()
        self.facts.close()
        self.kv.close()

    def __enter__(self) -> "KVMem":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _injected(segments: tuple, text_facts: int) -> tuple:
    """The prompt's segments ([head, fact_1..fact_k]) less the last `text_facts` facts, which the
    engine then prefills as text after the injected prefix (config.KVConfig.text_facts)."""
    return segments[: max(1, len(segments) - text_facts)]


def kv_first(facts: list[FactRecord]) -> list[FactRecord]:
    """Facts with a blob first, each part in the order given: the engine can only be handed a
    prefix of the prompt, so a fact served as text ends injection for every fact after it."""
    return sorted(facts, key=lambda f: f.kv_status != "encoded")


def _int_at_least(value: object, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _timestamp(value: object) -> str | None:
    """A caller's timestamp for facts: None, a datetime, or a non-empty string (ISO or free text)."""
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.isoformat()
    if not isinstance(value, str) or not value.strip():
        raise InvalidInputError(f"timestamp must be a datetime or a non-empty string, got {value!r}")
    return check_unicode("timestamp", value.strip())


def _with_timestamp(metadata: object, timestamp: str | None) -> object:
    """The caller's metadata with the timestamp added; metadata that is not a dict is passed on
    unchanged for the fact store to refuse with its own message."""
    if not timestamp or not (metadata is None or isinstance(metadata, dict)):
        return metadata
    return {**(metadata or {}), "timestamp": timestamp}


def _iso_or_none(timestamp: str | None) -> str | None:
    """Message timestamps are free text ("1:56 pm on 8 May, 2023"); only ISO ones become event_time.
    The text itself stays in the fact and in its metadata."""
    try:
        return datetime.fromisoformat(timestamp).isoformat() if timestamp else None
    except ValueError:
        return None


def _index_metadata(scope: Scope, metadata: dict) -> dict:
    return {**metadata, "_agent_id": scope.agent_id, "_run_id": scope.run_id}
