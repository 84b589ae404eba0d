"""A chat turn: the user's facts -> a prompt and a Plan -> the engine -> a ChatResult.

Facts go into the prompt in the order they were stored (conversation order), not by score: a
turn was encoded after the turns that preceded it, so keeping that order keeps the prompt
closest to what each fact's KV was computed with, and helps questions about time. In KV mode,
facts without a blob (pending, failed, evicted) go after those with one: the engine can only be
handed a prefix of the prompt, so one such fact early on would turn every later fact into text.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, replace
from typing import Iterator

from kvmem.config import Config
from kvmem.connector.plan import INJECT, Plan
from kvmem.encoding import salt
from kvmem.engine.prompt import PromptBuilder
from kvmem.engine.protocol import ChoiceDelta, Engine, EngineRequest, EngineResult
from kvmem.engine.sampling import Sampling
from kvmem.engine.tools import LiveContent, Tools, check_tool_turns
from kvmem.errors import EngineError, InvalidInputError
from kvmem.facts.inputs import check_context, int_at_least
from kvmem.facts.messages import check_messages
from kvmem.facts.scope import Scope
from kvmem.facts.store import FactRecord
from kvmem.facts.text import check_fact_text, check_unicode
from kvmem.keeper import BlobKeeper
from kvmem.kv.fidelity import point
from kvmem.kv.recompute import ENGINE_RULES, Recompute
from kvmem.model import verdict
from kvmem.results import ChatResult, Choice, ToolCallDelta
from kvmem.retrieval import Retrieval
from kvmem.trace import ChatTrace, FactTrace, TraceRing, clip, served
from kvmem.writes import Writes

# "auto": KV mode where `kvmem verify` passed for the served model, else text (Chats.resolved).
MODES = ("kv", "text", "off", "auto")
STORE = ("none", "user", "both")
TOO_LONG = InvalidInputError.CONTEXT_LENGTH_EXCEEDED


@dataclass(frozen=True)
class ChatArgs:
    """One chat's arguments, as KVMem.chat takes them."""

    user_id: str
    agent_id: str | None = None
    run_id: str | None = None
    k: int = 10
    filters: dict | None = None
    fact_ids: list[str] | None = None
    mode: str = "kv"
    max_tokens: int = 64
    logprobs: int | None = None
    text_facts: int | None = None  # the last facts KV mode prefills as text (None: kv.text_facts)
    recompute: Recompute | None = None  # fact tokens recomputed at injection (None: kv.recompute, kv.recompute_rule)
    fidelity: str | None = None  # a named point (kv/fidelity.py) instead of text_facts and recompute (None: kv's)
    sampling: Sampling = Sampling()  # greedy unless asked otherwise
    store: str = "none"  # write-back after the reply: "none", "user" (the last user turn) or "both" (+ reply)
    tools: Tools | None = None  # functions the reply may call (engine/tools.py)
    chat_id: str | None = None  # the id its x-ray is kept under (trace.py); None: a new one

    def check(self) -> None:
        if self.mode not in MODES:
            raise InvalidInputError(f"mode must be one of {MODES}, got {self.mode!r}", param="mode")
        if not int_at_least(self.max_tokens, 1):
            raise InvalidInputError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}", param="max_tokens")
        if self.logprobs is not None and not int_at_least(self.logprobs, 0):
            raise InvalidInputError(f"logprobs must be None or an int >= 0, got {self.logprobs!r}", param="logprobs")
        if self.text_facts is not None and not int_at_least(self.text_facts, 0):
            raise InvalidInputError(f"text_facts must be None or an int >= 0, got {self.text_facts!r}",
                                    param="text_facts")
        if self.recompute is not None and (not isinstance(self.recompute, Recompute)
                                           or self.recompute.rule not in ENGINE_RULES):
            raise InvalidInputError(f"recompute must be None or a Recompute with a rule of {ENGINE_RULES}, "
                                    f"got {self.recompute!r}", param="recompute")
        if self.fidelity is not None:
            try:
                point(self.fidelity)
            except ValueError as e:
                raise InvalidInputError(str(e), param="fidelity") from None
            if self.text_facts is not None or self.recompute is not None:
                raise InvalidInputError("fidelity names text_facts and recompute itself: give one or the others",
                                        param="fidelity")
        if self.store not in STORE:
            raise InvalidInputError(f"store must be one of {STORE}, got {self.store!r}", param="store")
        if not isinstance(self.sampling, Sampling):
            raise InvalidInputError(f"sampling must be a Sampling, got {type(self.sampling).__name__}",
                                    param="sampling")
        if self.tools is not None and not isinstance(self.tools, Tools):
            raise InvalidInputError(f"tools must be a Tools (Tools.from_openai), got {type(self.tools).__name__}",
                                    param="tools")


@dataclass(frozen=True)
class Prepared:
    facts: list[FactRecord]
    request: EngineRequest
    retrieval_s: float
    scores: dict[str, float]  # fact id -> retrieval score (empty when the chat named its facts)
    fact_tokens: tuple[int, ...] = ()  # each fact's tokens in the prompt, in prompt order
    question: str = ""
    traced: bool = True  # kept in the x-ray ring (not for scoring, which is no chat)
    assembly_s: float = 0.0  # after retrieval: tokenizing the facts, the prompt and the plan


class Chats:
    def __init__(self, config: Config, prompts: PromptBuilder, facts, retrieval: Retrieval, keeper: BlobKeeper,
                 engine: Engine | None, writes: Writes | None = None) -> None:
        """`writes`: where a chat's turns are stored when it asks (ChatArgs.store)."""
        self.config, self.prompts, self.facts = config, prompts, facts
        self.retrieval, self.keeper, self.engine, self.writes = retrieval, keeper, engine, writes
        self.traces = TraceRing(config.memory.trace_chats)  # the chat x-ray (trace.py)

    def need_engine(self) -> Engine:
        if self.engine is None:
            raise EngineError("this KVMem was opened without an engine (start_engine=False)")
        return self.engine

    def check_fact(self, text: str, context: str) -> str:
        """A fact's text as stored, refused when it is over memory.max_fact_tokens or does not fit
        the model's context after its context."""
        check_context(context)
        check_fact_text(text)
        limit = self.config.memory.max_fact_tokens
        if len(text) > limit * self.prompts.max_token_chars:  # refused before spending time tokenizing it
            raise InvalidInputError(f"fact is {len(text)} characters long; the limit is {limit} tokens "
                                    "(memory.max_fact_tokens)", param="facts", code=InvalidInputError.FACT_TOO_LARGE)
        tokens = self.prompts.fact_tokens(text)
        if len(tokens) > limit:
            raise InvalidInputError(f"fact is {len(tokens)} tokens long; the limit is {limit} (memory.max_fact_tokens)",
                                    param="facts", code=InvalidInputError.FACT_TOO_LARGE)
        needed = len(self.prompts.head_ids) + len(self.prompts.context_tokens(context)) + len(tokens)
        if needed >= self.config.engine.max_model_len:
            raise InvalidInputError("fact and its context do not fit the model's context length",
                                    param="facts", code=TOO_LONG)
        return text.strip()

    # -- a turn -----------------------------------------------------------------------------------

    def chat(self, messages, args: ChatArgs, *, cancel: threading.Event | None = None,
             reader: bool = True) -> ChatResult:
        args = self.resolved(args)
        p = self.prepare(messages, args)
        request = replace(p.request, reader=p.request.reader and reader)
        (result,) = self.need_engine().run([request], cancel=cancel)
        return self._stored(self.finish(result, p, args), messages, args)

    def stream(self, messages, args: ChatArgs, *,
               cancel: threading.Event | None = None) -> Iterator[str | ChoiceDelta | ToolCallDelta | ChatResult]:
        args = self.resolved(args)
        p = self.prepare(messages, args)
        items = self.need_engine().stream(p.request, cancel=cancel)
        if args.tools is None:
            for item in items:
                yield self._stored(self.finish(item, p, args), messages, args) if isinstance(item, EngineResult) else item
            return
        yield from self._tool_stream(items, p, messages, args)

    def _tool_stream(self, items, p: "Prepared", messages, args: ChatArgs) -> Iterator:
        """A stream whose reply may be tool calls: text goes out while it cannot be one (LiveContent),
        then, once the reply is read, the held-back text or the calls."""
        live, single = LiveContent(args.tools), args.sampling.n == 1
        for item in items:
            if not isinstance(item, EngineResult):
                index, text = (0, item) if isinstance(item, str) else (item.index, item.text)
                out = live.feed(index, text)
                if out:
                    yield out if single else ChoiceDelta(index, out)
                continue
            result = self._stored(self.finish(item, p, args), messages, args)
            for c in result.choices:
                rest = live.rest(c.index, bool(c.tool_calls))
                if rest:
                    yield rest if single else ChoiceDelta(c.index, rest)
                yield from (ToolCallDelta(c.index, j, call) for j, call in enumerate(c.tool_calls))
            yield result

    def _stored(self, result: ChatResult, messages, args: ChatArgs) -> ChatResult:
        """After a reply (never for a failed or aborted one): the write-back it asked for."""
        if args.store == "none" or self.writes is None:
            return result
        turns = [{"role": "user", "content": messages}] if isinstance(messages, str) else messages
        # Tool calls and results are not remembered: what is stored is what the people said.
        turns = [{k: v for k, v in m.items() if k != "tool_calls"} for m in turns if m["role"] != "tool"]
        # A reply that called tools is not kept: its words are the calls' wrapping, not something said.
        reply = "" if result.choices and result.choices[0].tool_calls else result.answer
        stored = self.writes.remember(turns, reply, Scope(args.user_id, args.agent_id, args.run_id), args.store)
        return replace(result, stored=stored)

    def score(self, messages, answer: str, args: ChatArgs, *, reader: bool = True) -> list[float]:
        if not isinstance(answer, str) or not answer.strip():
            raise InvalidInputError("answer must be a non-empty string", param="answer")
        check_unicode("answer", answer)
        args = self.resolved(args)
        p = self.prepare(messages, args)
        answer_ids = tuple(self.prompts.context_tokens(answer.strip()))
        # A salt of its own: a cached block must never cover the answer, whose positions would then
        # carry no logprobs. Injection does not depend on the salt, so kv mode still injects.
        scored = replace(p.request, token_ids=p.request.token_ids + answer_ids, score_last=len(answer_ids),
                         salt=f"{p.request.salt}:score:{uuid.uuid4().hex}", reader=p.request.reader and reader)
        (result,) = self.need_engine().run([scored])
        self.finish(result, replace(p, retrieval_s=0.0, traced=False), args)
        return list(result.scored)

    def resolved(self, args: ChatArgs) -> ChatArgs:
        """Mode "auto" as the mode it serves, so the result, trace and stats name that one: KV
        where the served model's cached `kvmem verify` verdict passed; text where it failed or
        there is none, since unchecked injection may be wrong and text prefill never is."""
        if args.mode != "auto":
            return args
        return replace(args, mode="kv" if verdict.passed(self.config.home, self.keeper.kv.fingerprint) else "text")

    def prepare(self, messages, args: ChatArgs) -> Prepared:
        args.check()
        self._check_token_ids(args.sampling)
        messages = [{"role": "user", "content": messages}] if isinstance(messages, str) else messages
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            check_messages(messages)  # its error names what is wrong
        check_tool_turns(messages)
        check_messages([m for m in messages if m.get("role") != "tool"])
        self._check_fits(messages, args.tools)
        t0 = time.perf_counter()
        facts, scores = self._facts(messages, args)
        retrieval_s = time.perf_counter() - t0
        self.need_engine()
        if args.mode == "kv":
            self.keeper.need_encoder().ensure_head()
        t1 = time.perf_counter()
        text_facts, rec = _fidelity_of(args, self.config.kv)
        if args.mode == "kv" and text_facts and self.config.kv.text_facts_rule == "relevant":
            facts = relevant_last(facts, scores, text_facts)
        tokens = self.prompts.fact_tokens_many([f.text for f in facts])
        prompt = self.prompts.chat([(f.id, t) for f, t in zip(facts, tokens)], messages, args.tools)
        if len(prompt.token_ids) + args.max_tokens > self.config.engine.max_model_len:
            raise InvalidInputError(f"prompt of {len(prompt.token_ids)} tokens + {args.max_tokens} new tokens "
                                    f"exceeds the model's {self.config.engine.max_model_len}", param="messages",
                                    code=TOO_LONG)
        # The facts start after the head: where the reader's KV map begins (sent only when reading with it).
        plan = Plan(INJECT, injected(prompt.segments, text_facts), map_from=len(self.prompts.head_ids),
                    recompute=rec if rec.on else None) if args.mode == "kv" else None
        # Only KV-mode chats read with the reader adapter; text mode and encoding never do.
        sampling = args.sampling
        if args.tools is not None and args.tools.forced:  # as vLLM's server: the calls' schema replaces response_format
            sampling = replace(sampling, json_schema=args.tools.schema(), json_object=False, schema_from="tools")
        request = EngineRequest(prompt.token_ids, salt(_purpose(args.mode, text_facts, rec), args.user_id),
                                args.max_tokens, plan, args.logprobs, reader=args.mode == "kv", route=args.user_id,
                                sampling=sampling)
        question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        return Prepared(facts, request, retrieval_s, scores, tuple(map(len, tokens)), clip(question),
                        assembly_s=time.perf_counter() - t1)

    def _check_token_ids(self, sampling: Sampling) -> None:
        """Token ids the model's vocabulary has (vLLM would fail the request late, without a field)."""
        vocab = len(self.prompts.tokenizer)
        for param, ids in (("logit_bias", sampling.logit_bias), ("stop_token_ids", sampling.stop_token_ids)):
            unknown = [t for t in ids if t >= vocab]
            if unknown:
                raise InvalidInputError(f"{param}: token ids {unknown[:5]} are not in the model's vocabulary "
                                        f"({vocab} tokens)", param=param)

    def _check_fits(self, messages: list[dict], tools: Tools | None) -> None:
        """Refuse a conversation too long to fit before tokenizing it (megabytes take seconds)."""
        chars = sum(len(m["content"]) + len(repr(m.get("tool_calls") or "")) for m in messages)
        chars += len(repr(tools.specs)) if tools is not None else 0
        bound = self.config.engine.max_model_len * self.prompts.max_token_chars  # no token is longer
        if chars > bound:
            raise InvalidInputError(f"messages of {chars} characters (at least {-(-chars // self.prompts.max_token_chars)}"
                                    f" tokens) exceed the model's {self.config.engine.max_model_len}",
                                    param="messages", code=TOO_LONG)

    def _facts(self, messages: list[dict], a: ChatArgs) -> tuple[list[FactRecord], dict[str, float]]:
        """The chat's facts in prompt order, and their retrieval scores."""
        Scope(a.user_id, a.agent_id, a.run_id)
        if a.mode == "off":
            return [], {}
        if a.fact_ids is not None:
            return self._chosen(a.fact_ids, a.user_id), {}
        question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
        if not question.strip():
            return [], {}
        found = self.retrieval.search_facts(question, user_id=a.user_id, agent_id=a.agent_id, run_id=a.run_id,
                                            k=a.k, filters=a.filters)
        hits, facts = [h for h, _ in found], [f for _, f in found]
        facts.sort(key=lambda f: (f.created_at, f.position or 0, f.id))
        return (kv_first(facts) if a.mode == "kv" else facts), {h.id: h.score for h in hits}

    def _chosen(self, fact_ids, user_id: str) -> list[FactRecord]:
        """Exactly these facts, in this order (retrieval skipped); all must be the user's."""
        if not isinstance(fact_ids, (list, tuple)):
            raise InvalidInputError(f"fact_ids must be a list of fact ids, got {type(fact_ids).__name__}",
                                    param="fact_ids")
        facts = [self.facts.get(i) for i in fact_ids]
        foreign = [f.id for f in facts if f.scope.user_id != user_id]
        if foreign:
            raise InvalidInputError(f"facts {foreign} do not belong to user {user_id!r}", param="fact_ids")
        now = time.time()
        return [f for f in facts if not f.expired(now)]  # an expired fact is never injected, named or not

    def finish(self, r: EngineResult, p: Prepared, args: ChatArgs) -> ChatResult:
        report = r.injection
        self.keeper.after_chat(args.mode, p.facts, report)
        claimed = report.claimed_tokens if report else 0
        choices = tuple(self._choice(Choice(c.index, c.text.strip(), c.token_ids, c.finish_reason, c.logprobs), args)
                        for c in r.choices)
        trace = self._trace(r, p, args)
        return ChatResult(
            trace_id=trace.id if args.mode != "off" and p.traced else "",
            answer=choices[0].answer if choices and choices[0].tool_calls else r.text.strip(), mode=args.mode, fact_ids=tuple(f.id for f in p.facts), ttft_s=r.ttft_s,
            latency_s=r.latency_s, prompt_tokens=r.prompt_tokens, injected_tokens=claimed,
            cached_tokens=r.cached_tokens - claimed, fallbacks=report.facts_as_text if report else 0,
            fallback_reasons=dict(report.fallbacks) if report else {}, retrieval_s=p.retrieval_s,
            token_ids=r.token_ids, first_logprobs=r.first_logprobs, reader_adapter=r.adapter,
            choices=choices, recomputed_tokens=report.recomputed_tokens if report else 0,
            assembly_s=p.assembly_s, connector_ms=dict(report.profile_ms) if report else {},
        )

    def _trace(self, r: EngineResult, p: Prepared, args: ChatArgs) -> ChatTrace:
        """The chat's x-ray, kept in the scope's ring (trace.py)."""
        report, plan = r.injection, p.request.plan
        ids = [f.id for f in p.facts]
        how = served(ids, args.mode, len(plan.segments) - 1 if plan else 0, report.facts_from_blobs if report else 0,
                     dict(report.fallbacks) if report else {})
        facts = tuple(FactTrace(f.id, clip(f.text), p.scores.get(f.id), kind, reason, n)
                      for f, (kind, reason), n in zip(p.facts, how, p.fact_tokens))
        reasons: dict[str, int] = {}
        for fact in facts:
            if fact.reason not in (None, "mode"):
                reasons[fact.reason] = reasons.get(fact.reason, 0) + 1
        trace = ChatTrace(args.chat_id or uuid.uuid4().hex, args.user_id, args.agent_id, args.run_id, time.time(), args.mode,
                          p.question, facts, r.prompt_tokens, report.claimed_tokens if report else 0,
                          round(r.ttft_s * 1000, 3), round(p.retrieval_s * 1000, 3), reasons)
        if args.mode != "off" and p.traced:  # a chat without memory has nothing to show
            self.traces.record(trace)
        return trace

    def _choice(self, c: Choice, args: ChatArgs) -> Choice:
        """A reply read for tool calls, when the chat has tools: calls found end it with "tool_calls"
        (unless max_tokens cut it) and its answer is the text around them."""
        if args.tools is None:
            return c
        content, calls = args.tools.parse(c.answer, self.prompts.tokenizer)
        if not calls:
            return c
        content = content.strip() if content else None
        reason = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
        return replace(c, answer=content or "", finish_reason=reason, tool_calls=calls, content=content)


def _fidelity_of(args: ChatArgs, kv) -> tuple[int, Recompute]:
    """(text_facts, recompute) of a chat: its own, else its fidelity point's, else the configured."""
    if args.fidelity is not None:
        chosen = point(args.fidelity)
        return chosen.text_facts, chosen.recompute
    text_facts = kv.text_facts_setting if args.text_facts is None else args.text_facts
    return text_facts, args.recompute or kv.recompute_setting


def injected(segments: tuple, text_facts: int) -> tuple:
    """The prompt's segments ([head, fact_1..fact_k]) less the last `text_facts` facts, which the
    engine then prefills as text after the injected prefix (config.KVConfig.text_facts)."""
    return segments[: max(1, len(segments) - text_facts)]


def relevant_last(facts: list[FactRecord], scores: dict[str, float], n: int) -> list[FactRecord]:
    """The `n` best-scored facts moved after the others, each part in the order given: KV mode
    prefills its last facts as text (kv.text_facts_rule = "relevant"), so the facts that matter
    most to the question attend to all the others as in text prefill."""
    best = {f.id for f in sorted(facts, key=lambda f: -scores.get(f.id, float("-inf")))[:n]}
    return [f for f in facts if f.id not in best] + [f for f in facts if f.id in best]


def kv_first(facts: list[FactRecord]) -> list[FactRecord]:
    """Facts with a blob first, each part in the order given: the engine can only be handed a
    prefix of the prompt, so a fact served as text ends injection for every fact after it."""
    return sorted(facts, key=lambda f: f.kv_status != "encoded")


def _purpose(mode: str, text_facts: int, rec: Recompute) -> str:
    """What a chat's cache salt names besides its user. Facts prefilled as text and recomputed
    tokens hold other KV than plain injection's over the very same prompt tokens, so cached
    blocks are shared only at equal settings (a chat asking for text facts once reused a plain
    chat's blocks of them: plain KV where text was asked for)."""
    if mode != "kv":
        return mode
    return "kv" + (f":text-facts-{text_facts}" if text_facts else "") + (f":{rec.tag}" if rec.on else "")
