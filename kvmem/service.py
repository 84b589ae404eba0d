"""The memory service: Mem0's API shape, with retrieved facts injected as KV.

    with KVMem() as mem:                                   # bundled SmolLM2 on vLLM
        mem.add([{"role": "user", "content": "My sister adopted a puppy."},
                 {"role": "user", "content": "She named it Bruno."}], user_id="alice")
        mem.search("What is the puppy called?", user_id="alice", k=3)
        r = mem.chat("What is my sister's puppy called?", user_id="alice", k=5, mode="kv")

KVMem is the facade and composition root: it builds the rooms (retrieval, keeper, writes, chat:
the code map in docs/how-it-works.md says what each does) and hands them to each other.
"""

from __future__ import annotations

import threading
from datetime import date, datetime
from typing import Iterator

from kvmem.chat import MODES, ChatArgs, Chats  # noqa: F401 - MODES is part of the API
from kvmem.config import Config
from kvmem.encoding import Encoder
from kvmem.engine.sampling import Sampling
from kvmem.engine.start import start_engine as start_engine_for
from kvmem.extract.infer import InferResult, Inferrer
from kvmem.extract.llm import open_llm
from kvmem.facts import open_fact_store
from kvmem.facts.expiry import KEEP
from kvmem.facts.scope import Scope
from kvmem.facts.store import FactRecord, HistoryEvent
from kvmem.keeper import ENCODE_MODES, BlobKeeper  # noqa: F401 - ENCODE_MODES is part of the API
from kvmem.kv.store import KVStore
from kvmem.model import resolve_model
from kvmem.results import AddResult, ChatResult, MemoryStatus, SearchHit
from kvmem.retrieval import Retrieval
from kvmem.writes import Writes


class KVMem:
    def __init__(self, config: Config | None = None, *, engine=None, start_engine: bool = True,
                 embedder=None, background: bool = True) -> None:
        from transformers import AutoTokenizer

        from kvmem.embed import default_embedder
        from kvmem.engine.prompt import PromptBuilder

        self.config = c = config or Config.from_env()
        self.model = resolve_model(c.engine.model, c.models_dir, c.engine.dtype)
        self.prompts = PromptBuilder(AutoTokenizer.from_pretrained(str(self.model.path)), c.prompt)
        self.kv = KVStore(c.kv_dir, self.model.fingerprint, c.kv.hot_cache_mib << 20, shared_url=c.kv.shared_url)
        self.facts = open_fact_store(c.database_url, c.home / "facts.sqlite")
        self.embedder = embedder or default_embedder()
        self._write_lock = threading.RLock()  # keeps store, indexes and blobs in step
        self._owns_engine = engine is None and start_engine
        self.engine = engine if engine is not None else (start_engine_for(c, self.model, self.kv) if start_engine else None)
        # Behind replicas this process only checks that a blob is stored (a header, or the shared
        # tier's stamp) rather than reading it whole: it never injects, the replica verifies.
        encoder = Encoder(self.engine, self.prompts, self.kv, self.facts,
                          verify_blobs=not c.engine.url) if self.engine else None
        self.keeper = BlobKeeper(self.kv, self.facts, c.kv, self._write_lock, encoder)
        self.retrieval = Retrieval(self.facts, self.embedder, c.retrieval, self._write_lock,
                                   on_unindex=self.keeper.forget)
        self.chats = Chats(c, self.prompts, self.facts, self.retrieval, self.keeper, self.engine)
        self.writes = self.chats.writes = Writes(c, self.facts, self.retrieval, self.keeper, self.chats.check_fact,
                                                 self._write_lock)
        self.inferrer = Inferrer(open_llm(c.extract, self.chats), self.retrieval, self.facts, self.writes,
                                 c.extract.on_unavailable)
        if encoder is not None and background:
            encoder.start()

    @property
    def encoder(self) -> Encoder | None:
        return self.keeper.encoder

    @property
    def stats(self):
        """Chats per mode, fallbacks, tier hits and misses, evictions, since this KVMem opened."""
        return self.keeper.stats

    def add(self, messages: str | list[dict] | None = None, *, user_id: str, agent_id: str | None = None,
            run_id: str | None = None, facts: list[str] | None = None, metadata: dict | None = None,
            context: str = "", window: int | None = None, encode: str = "sync",
            timestamp: str | datetime | None = None, origin: str = "",
            expiration_date: str | date | None = None, infer: bool = False) -> AddResult | InferResult:
        """Store facts (`facts=[...]`, or a str) or a conversation (a list of messages, one fact per turn).

        `timestamp` (facts only; messages carry their own): when the facts held or were said. It
        is shown in front of each fact as a turn's is ("[9 May 2023] ..."), kept in the metadata,
        and an ISO one becomes the facts' event_time. `context` (facts only): text each fact's KV is
        encoded after, and searched with. `origin` (facts only): the message the facts were drawn
        from; searched with them, never encoded or shown (on LoCoMo observations, recall@10 0.659
        -> 0.695, while encoding after the message cost KV-mode log-likelihood). `expiration_date`
        (Mem0's: "2025-12-31" holds through that day, UTC; or a datetime): from then on the facts
        are never searched, listed or injected, and the next sweep forgets them (sweep_expired).
        `infer=True` (Mem0's): an LLM extracts facts from `messages` and reconciles them with the
        stored ones (ADD/UPDATE/DELETE: kvmem/extract/) -> InferResult; nothing stored if it is down."""
        add = self.inferrer.add if infer else self.writes.add
        return add(messages, Scope(user_id, agent_id, run_id), facts=facts, metadata=metadata, context=context,
                   window=window, encode=encode, timestamp=timestamp, origin=origin, expiration_date=expiration_date)

    def encode_pending(self, timeout: float = 600.0) -> bool:
        """Block until the background encoder has nothing left to do (started now if this KVMem
        was opened with background=False). EngineError when opened without an engine."""
        (encoder := self.keeper.need_encoder()).start()
        return encoder.wait_idle(timeout)

    def update(self, fact_id: str, text: str, metadata: dict | None = None, *,
               expiration_date: str | date | None = KEEP) -> FactRecord:
        """New text: re-embedded, re-indexed and re-encoded (the old KV is dropped at once).
        `expiration_date`: a new one, or None for never; left out, the fact keeps its own."""
        return self.writes.update(fact_id, text, metadata, expiration_date)

    def sweep_expired(self) -> int:
        """Forget the facts whose expiration_date has passed from every store (text, vectors, KV
        blobs in every tier), as delete does; -> how many. Every add sweeps first as well."""
        return self.writes.sweep_expired()

    def reembed(self, *, user_id: str | None = None, batch: int = 256, progress: bool = False) -> int:
        """Recompute every stored fact's search vector (one user's with `user_id`) the way `add`
        makes it now (kvmem.embed.fact) and re-index it; -> how many were rewritten. A home keeps
        the vectors it was written with: after an upgrade that changes how they are made, its
        facts rank as before until this runs."""
        return self.retrieval.reembed(user_id=user_id, batch=batch, progress=progress)

    def delete(self, fact_id: str) -> None:
        """Forget: the text, the vector and the KV blob are gone; the history keeps the event only."""
        self.writes.delete(fact_id)

    def delete_all(self, *, user_id: str, agent_id: str | None = None, run_id: str | None = None,
                   filters: dict | None = None) -> int:
        """Forget the scope's facts, those whose metadata `filters` match when given (as get_all's)."""
        return self.writes.delete_all(Scope(user_id, agent_id, run_id), filters)

    def reset(self) -> None:
        """Forget everything: every user's facts, vectors, history and blobs."""
        self.writes.reset()

    def get(self, fact_id: str) -> FactRecord:
        return self.facts.get(fact_id)

    def get_all(self, *, user_id: str, agent_id: str | None = None, run_id: str | None = None,
                filters: dict | None = None, limit: int = 100, offset: int = 0) -> list[FactRecord]:
        return self.retrieval.get_all(user_id=user_id, agent_id=agent_id, run_id=run_id, filters=filters,
                                      limit=limit, offset=offset)

    def count(self, *, user_id: str, agent_id: str | None = None, run_id: str | None = None,
              filters: dict | None = None) -> int:
        return self.retrieval.count(user_id=user_id, agent_id=agent_id, run_id=run_id, filters=filters)

    def history(self, fact_id: str) -> list[HistoryEvent]:
        return self.facts.history(fact_id)

    def search(self, query: str, *, user_id: str, agent_id: str | None = None, run_id: str | None = None,
               k: int = 10, filters: dict | None = None, ranking: str | None = None) -> list[SearchHit]:
        """The scope's top-k facts for `query`; `ranking` ("hybrid", "dense", "lexical") overrides
        the configured RetrievalConfig.mode for this call."""
        return self.retrieval.search(query, user_id=user_id, agent_id=agent_id, run_id=run_id, k=k,
                                     filters=filters, ranking=ranking)

    def chat(self, messages: str | list[dict], *, user_id: str, cancel: threading.Event | None = None,
             reader: bool = True, **options) -> ChatResult:
        """Answer with the user's top-k facts for the last user message, in the order chat.py gives.
        `options`: chat.ChatArgs' fields: agent_id, run_id, k (10), filters; fact_ids (exactly these
        facts, no retrieval); mode ("kv"); max_tokens (64); logprobs (20); text_facts (the last facts
        prefilled as text in KV mode); sampling (engine/sampling.py: greedy unless given); store
        ("user": the last user turn stored as a fact after the reply, "both": the reply too); tools
        (engine/tools.Tools.from_openai). Thread-safe (the engine batches chats); `cancel` set from
        another thread aborts it (RequestCancelled). `reader=False`: KV mode without the reader adapter."""
        return self.chats.chat(messages, _chat_args(user_id, {"logprobs": 20, **options}), cancel=cancel, reader=reader)

    def chat_stream(self, messages: str | list[dict], *, user_id: str, cancel: threading.Event | None = None,
                    **options) -> Iterator:
        """Like chat (logprobs None by default), streaming: yields text deltas (str; ChoiceDelta(index,
        text) when n > 1) and, with tools, ToolCallDelta, as they come, then the ChatResult. Closing
        it early, or `cancel`, aborts it."""
        return self.chats.stream(messages, _chat_args(user_id, options), cancel=cancel)

    def score(self, messages: str | list[dict], answer: str, *, user_id: str, fact_ids: list[str],
              mode: str = "kv", reader: bool = True, recompute=None, text_facts: int | None = None) -> list[float]:
        """Teacher forcing: the logprob of each token of `answer` as the reply, with these facts
        (read as `chat` reads them, `reader`, `recompute` and `text_facts` included)."""
        args = ChatArgs(user_id, k=1, fact_ids=fact_ids, mode=mode, max_tokens=1, recompute=recompute,
                        text_facts=text_facts)
        return self.chats.score(messages, answer, args, reader=reader)

    def scopes(self, user_prefix: str = ""):
        """Every scope (user, agent, run) whose user id starts with `user_prefix`: keeper.ScopeSummary."""
        return self.keeper.scopes(user_prefix)

    def blob(self, fact_id: str):
        """Where the fact's KV blob is and its size (keeper.BlobInfo)."""
        return self.keeper.blob(fact_id)

    def recent_chats(self, user_id: str) -> list:
        """The x-rays the user's scope still keeps (trace.ChatTrace), newest first."""
        return self.chats.traces.recent(user_id)

    def trace(self, chat_id: str):
        """A recent chat's x-ray (trace.ChatTrace, by ChatResult.trace_id); None once its scope's ring dropped it."""
        return self.chats.traces.get(chat_id)

    def token_texts(self, token_ids) -> list[str]:
        """Each token's text, decoded alone (the `token` of OpenAI's logprobs)."""
        return [self.prompts.tokenizer.decode([t]) for t in token_ids]

    def kv_tiers(self) -> dict[str, int | None]:
        """The KV tiers at a glance (keeper.KVTiers): bytes and budgets, hits and misses,
        evictions and re-encodes of evicted facts."""
        return self.keeper.tiers().as_dict()

    def encode_queue(self) -> int:
        """Facts waiting for their KV: status().encode_queue without sizing every blob."""
        return self.keeper.queue_depth()

    def status(self) -> MemoryStatus:
        """A snapshot for /metrics and the CLI: facts, encode queue, blob bytes, tiers, engine."""
        return MemoryStatus(facts=self.facts.count(), encode_queue=self.encode_queue(),
                            kv_bytes=self.kv.total_bytes(), tiers=self.kv_tiers(),
                            engine=self.engine.status() if self.engine is not None else None,
                            fact_encodes=self.encoder.sent if self.encoder is not None else 0)

    def warm_up(self) -> None:
        """What a long-lived process can do once before it serves: load the query embedder and the
        ranking kernels, so the first chat's retrieval is not ~1 s (Retrieval.warm). kvmem serve
        does not call it yet: its memory in the suite's topology test is to be measured first."""
        self.retrieval.warm()

    def close(self) -> None:
        self.retrieval.close()
        self.keeper.close()
        if self._owns_engine and self.engine is not None:
            self.engine.close()
        self.facts.close()
        self.kv.close()

    def __enter__(self) -> "KVMem":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _chat_args(user_id: str, options: dict) -> ChatArgs:
    return ChatArgs(user_id, **{**options, "sampling": options.get("sampling") or Sampling()})
