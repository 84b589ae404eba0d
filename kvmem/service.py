"""The kvmem client: register facts for a user, encode their KV, chat with them injected.

    with KVMem() as mem:                       # the bundled SmolLM2 on vLLM
        f = mem.add_fact("alice", "Alice's dog is called Biscuit.")
        mem.encode()
        r = mem.chat("alice", "What is my dog called?", fact_ids=[f.id], mode="kv")
        print(r.answer, r.ttft_s, r.injected_tokens)

mode="text" sends the identical prompt tokens without injection: the baseline every memory
layer uses today. Retrieval (choosing fact_ids from a query) arrives with the memory service.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from tqdm import tqdm

from kvmem.config import Config
from kvmem.errors import BlobError, InvalidInputError
from kvmem.facts import Fact, FactRegistry
from kvmem.facts.registry import check_user_id
from kvmem.kv.store import KVStore
from kvmem.model import resolve_model

log = logging.getLogger(__name__)
MODES = ("kv", "text")


@dataclass(frozen=True)
class ChatResult:
    answer: str
    mode: str
    fact_ids: tuple[str, ...]
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    injected_tokens: int  # tokens the connector wrote from blobs (0 in text mode)
    cached_tokens: int  # tokens served by vLLM's own prefix cache
    fallbacks: int  # facts served as text because their blob was missing/corrupt/stale
    fallback_reasons: dict[str, str] = field(default_factory=dict)
    token_ids: tuple[int, ...] = ()
    first_logprobs: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EncodeReport:
    encoded: int
    failed: tuple[str, ...]
    seconds: float


class KVMem:
    def __init__(self, config: Config | None = None) -> None:
        from kvmem.engine.llm import Engine
        from kvmem.engine.prompt import PromptBuilder

        self.config = config or Config.from_env()
        self.model = resolve_model(self.config.engine.model, self.config.models_dir, self.config.engine.dtype)
        self.engine = Engine(self.model, self.config)
        self.prompts = PromptBuilder(self.engine.tokenizer, self.config.prompt)
        self.store = KVStore(self.config.kv_dir, self.model.fingerprint)
        self.facts = FactRegistry()
        self.stats: Counter[str] = Counter()

    # -- write path -----------------------------------------------------------------------------

    def add_fact(self, user_id: str, text: str, context: str = "", fact_id: str | None = None) -> Fact:
        check_user_id(user_id)
        fact = Fact(fact_id or FactRegistry.new_id(), user_id, text.strip() if isinstance(text, str) else text,
                    self.prompts.fact_tokens(text), context, self.prompts.context_tokens(context))
        if len(self.prompts.head_ids) + len(fact.context_tokens) + len(fact.tokens) >= self.engine.max_model_len:
            raise InvalidInputError(f"fact of {len(fact.tokens)} tokens does not fit the model's context")
        return self.facts.add(fact)

    def encode(self, fact_ids: list[str] | None = None, *, keep_rotated: bool = False,
               batch: int = 64) -> EncodeReport:
        """Compute and store the KV of the given facts (default: every registered fact)."""
        from kvmem.engine.llm import EngineRequest
        from kvmem.engine.plan import ENCODE, Plan

        facts = [self.facts.get(i) for i in fact_ids] if fact_ids is not None else self.facts.all()
        start = time.perf_counter()
        self._ensure_head()
        requests = []
        for f in facts:
            prompt = self.prompts.encoding(f.id, f.tokens, f.context_tokens)
            requests.append(EngineRequest(prompt.token_ids, _salt("encode", f.user_id), max_tokens=1,
                                          plan=Plan(ENCODE, prompt.segments, keep_rotated)))
        with tqdm(total=len(requests), desc="encoding facts", unit="fact", disable=len(requests) < batch) as bar:
            for i in range(0, len(requests), batch):
                self.engine.run(requests[i : i + batch])
                bar.update(len(requests[i : i + batch]))
        failed = tuple(f.id for f in facts if not self._blob_ok(f.id))
        self.stats["encoded"] += len(facts) - len(failed)
        self.stats["encode_failures"] += len(failed)
        return EncodeReport(len(facts) - len(failed), failed, time.perf_counter() - start)

    def _ensure_head(self) -> None:
        from kvmem.engine.llm import EngineRequest
        from kvmem.engine.plan import ENCODE, Plan

        if self._blob_ok(self.prompts.head_id):
            return
        prompt = self.prompts.head_encoding()
        self.engine.run([EngineRequest(prompt.token_ids, _salt("encode", ""), max_tokens=1,
                                       plan=Plan(ENCODE, prompt.segments))])

    def _blob_ok(self, fact_id: str) -> bool:
        try:
            self.store.get(fact_id)
            return True
        except BlobError:
            return False

    # -- read path ------------------------------------------------------------------------------

    def chat(self, user_id: str, message: str | list[dict], fact_ids: list[str] = (), *, mode: str = "kv",
             max_tokens: int = 64, logprobs: int | None = 20) -> ChatResult:
        return self.chat_many([(user_id, message, fact_ids)], mode=mode, max_tokens=max_tokens, logprobs=logprobs)[0]

    def chat_many(self, chats: list[tuple[str, str | list[dict], list[str]]], *, mode: str = "kv",
                  max_tokens: int = 64, logprobs: int | None = 20) -> list[ChatResult]:
        """Several (user_id, message, fact_ids) chats submitted together, batched by the engine."""
        from kvmem.engine.llm import EngineRequest
        from kvmem.engine.plan import INJECT, Plan

        if mode not in MODES:
            raise InvalidInputError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "kv":
            self._ensure_head()
        requests, used = [], []
        for user_id, message, fact_ids in chats:
            facts = self._facts_for(user_id, fact_ids)
            messages = [{"role": "user", "content": message}] if isinstance(message, str) else list(message)
            prompt = self.prompts.chat([(f.id, f.tokens) for f in facts], messages)
            if len(prompt.token_ids) + max_tokens > self.engine.max_model_len:
                raise InvalidInputError(f"prompt of {len(prompt.token_ids)} tokens + {max_tokens} new tokens "
                                        f"exceeds the model's {self.engine.max_model_len}")
            plan = Plan(INJECT, prompt.segments) if mode == "kv" else None
            requests.append(EngineRequest(prompt.token_ids, _salt(mode, user_id), max_tokens, plan, logprobs))
            used.append(tuple(f.id for f in facts))
        results = [self._chat_result(r, mode, ids) for r, ids in zip(self.engine.run(requests), used)]
        self.stats[f"chat_{mode}"] += len(results)
        self.stats["fallbacks"] += sum(r.fallbacks for r in results)
        return results

    def _facts_for(self, user_id: str, fact_ids) -> list[Fact]:
        check_user_id(user_id)
        facts = [self.facts.get(i) for i in fact_ids]
        foreign = [f.id for f in facts if f.user_id != user_id]
        if foreign:
            raise InvalidInputError(f"facts {foreign} do not belong to user {user_id!r}")
        return facts

    @staticmethod
    def _chat_result(r, mode: str, fact_ids: tuple[str, ...]) -> ChatResult:
        c = r.connector
        return ChatResult(
            answer=r.text.strip(), mode=mode, fact_ids=fact_ids, ttft_s=r.ttft_s, latency_s=r.latency_s,
            prompt_tokens=r.prompt_tokens, injected_tokens=c.get("claimed_tokens", 0),
            cached_tokens=r.cached_tokens - c.get("claimed_tokens", 0), fallbacks=c.get("facts_as_text", 0),
            fallback_reasons=c.get("fallbacks", {}), token_ids=r.token_ids, first_logprobs=r.first_logprobs,
        )

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> "KVMem":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _salt(purpose: str, user_id: str) -> str:
    """Per user and purpose: KV-mode blocks (approximate) never serve text mode, encoding or others."""
    return hashlib.sha256(f"kvmem\0{purpose}\0{user_id}".encode()).hexdigest()[:32]
