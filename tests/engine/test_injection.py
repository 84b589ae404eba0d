"""Oracle tests on the real engine: injected KV against text prefill of identical tokens."""

from __future__ import annotations

import pytest
import torch

from kvmem.bench import oracle
from kvmem.bench.oracle import FACTS, encode_after_true_prefix
from kvmem.errors import InvalidInputError
from tests.helpers import add_fact, tokens


def logprob_gap(a: dict[int, float], b: dict[int, float]) -> float:
    """Largest |logprob difference| over tokens in both top-n lists (which must overlap)."""
    assert len(a.keys() & b.keys()) >= len(a) // 2, "top-n lists barely overlap"
    return oracle.logprob_gap(a, b)


def test_k1_injection_matches_text_prefill(mem):
    fact = add_fact(mem, "oracle", FACTS[0])
    assert fact.kv_status == "encoded"
    q = "How old is my daughter?"
    text = mem.chat(q, user_id="oracle", fact_ids=[fact.id], mode="text", max_tokens=24)
    cached = mem.chat(q, user_id="oracle", fact_ids=[fact.id], mode="text", max_tokens=24)  # engine's own prefix-cache path
    kv = mem.chat(q, user_id="oracle", fact_ids=[fact.id], mode="kv", max_tokens=24)

    assert kv.injected_tokens == len(mem.prompts.head_ids) + len(tokens(mem, fact))
    assert kv.fallbacks == 0
    cache_noise = logprob_gap(text.first_logprobs, cached.first_logprobs)
    kv_gap = logprob_gap(text.first_logprobs, kv.first_logprobs)
    print(f"\nk=1 top-20 logprob gap: injection {kv_gap:.4f}, engine prefix-cache hit {cache_noise:.4f}")
    # Tolerance: bf16 kernel noise. A fresh prefill and the engine's own cached-prefix path differ
    # by `cache_noise`; injection recomputes the same K/V (rotation in fp32, rounded to bf16), so it
    # may differ by that much again, plus one bf16 rounding step of logits (~2^-8 relative * |lp|).
    tol = 2 * cache_noise + 0.05
    assert kv_gap <= tol, f"injection deviates {kv_gap:.4f} > {tol:.4f}"
    assert_same_greedy(text, kv, tol)


def assert_same_greedy(a, b, tol):
    """Same greedy tokens, unless they part where `a`'s top two were a near tie (within tol)."""
    if a.token_ids == b.token_ids:
        return
    i = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
    assert i > 0 or _near_tie(a.first_logprobs, tol), f"greedy answers differ: {a.answer!r} vs {b.answer!r}"


def _near_tie(logprobs, tol):
    top = sorted(logprobs.values(), reverse=True)
    return top[0] - top[1] <= tol


def test_k10_injection_claims_all_facts(mem):
    result = mem.add(facts=FACTS, user_id="k10")
    assert result.encode.encoded == 10
    ids = list(result.ids)
    q = "What is the name of my cat?"
    text = mem.chat(q, user_id="k10", fact_ids=ids, mode="text", max_tokens=24)
    kv = mem.chat(q, user_id="k10", fact_ids=ids, mode="kv", max_tokens=24)
    expected = len(mem.prompts.head_ids) + sum(len(tokens(mem, mem.get(i))) for i in ids)
    assert kv.injected_tokens == expected and kv.cached_tokens == 0
    assert kv.fallbacks == 0 and kv.answer
    top_text = max(text.first_logprobs, key=text.first_logprobs.get)
    top_kv = max(kv.first_logprobs, key=kv.first_logprobs.get)
    gap = logprob_gap(text.first_logprobs, kv.first_logprobs)
    print(f"\nk=10: injected {kv.injected_tokens} tokens; first token top-1 agree={top_text == top_kv}, "
          f"top-20 logprob gap {gap:.3f}; text={text.answer!r} kv={kv.answer!r}")
    # Facts encoded independently do not attend to each other, so this is an approximation, not
    # noise. Loose bound: text mode's first token stays a top-5 candidate under injection.
    ranked_kv = sorted(kv.first_logprobs, key=kv.first_logprobs.get, reverse=True)
    assert top_text in ranked_kv[:5]
    assert gap < 3.0


def test_stored_keys_are_the_engine_cache_at_their_encoded_position(mem):
    """A blob holds the keys as the engine cached them (rotated, bf16) with the position they
    were encoded at: encoding the same fact text with no context puts it elsewhere, and moving
    those keys to the first blob's position reproduces them up to bf16 rounding."""
    from kvmem.connector.rope import KeyRotator

    fact = add_fact(mem, "rope", FACTS[1], context="We talked about moving abroad.", encode="none")
    plain = add_fact(mem, "rope-plain", FACTS[1], encode="none")
    mem.encoder.encode([fact, plain])
    blob, other = mem.kv.get(fact.id), mem.kv.get(plain.id)
    head = len(mem.prompts.head_ids)
    assert blob.key_position == head + len(mem.prompts.context_tokens(fact.context))
    assert other.key_position == head and blob.key.dtype == torch.bfloat16 == blob.value.dtype
    # Layer 0 sees only the token itself (no context yet): its keys differ by rotation alone.
    rotator = KeyRotator(_model_rope(mem))
    n = blob.num_tokens
    moved = other.key[:1].float().contiguous()
    rotator.move(moved, torch.arange(head, head + n), torch.arange(blob.key_position, blob.key_position + n))
    assert torch.allclose(moved, blob.key[:1].float(), rtol=2**-6, atol=2e-2)
    assert not torch.allclose(other.key[:1].float(), blob.key[:1].float(), rtol=2**-6, atol=2e-2)


def _model_rope(mem):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    hf = mem.engine._llm.llm_engine.vllm_config.model_config.hf_text_config
    with set_current_vllm_config(VllmConfig()):
        return get_rope(64, max_position=hf.max_position_embeddings, rope_parameters=hf.rope_parameters,
                        dtype=torch.bfloat16)


def test_k10_facts_encoded_after_their_true_prefix_reproduce_text_prefill(mem):
    """With each fact encoded after exactly the tokens that precede it in the prompt, injecting
    ten segments must equal text prefill: this pins slot mapping and multi-segment assembly."""
    from kvmem.engine.protocol import EngineRequest
    from kvmem.connector.plan import ENCODE, Plan
    from kvmem.encoding import salt

    ids = list(mem.add(facts=FACTS, user_id="k10-exact", encode="none").ids)
    q = [{"role": "user", "content": "What is the name of my cat?"}]
    prompt = mem.prompts.chat([(i, tokens(mem, mem.get(i))) for i in ids], q)
    mem.engine.run([EngineRequest(prompt.token_ids[: seg.end], salt("encode", "k10-exact"), max_tokens=1,
                                  plan=Plan(ENCODE, (seg,))) for seg in prompt.segments[1:]])
    text = mem.chat(q, user_id="k10-exact", fact_ids=ids, mode="text", max_tokens=24)
    cached = mem.chat(q, user_id="k10-exact", fact_ids=ids, mode="text", max_tokens=24)
    kv = mem.chat(q, user_id="k10-exact", fact_ids=ids, mode="kv", max_tokens=24)
    assert kv.injected_tokens == prompt.memory_tokens and kv.fallbacks == 0
    cache_noise = logprob_gap(text.first_logprobs, cached.first_logprobs)
    gap = logprob_gap(text.first_logprobs, kv.first_logprobs)
    print(f"\nk=10 with true-prefix encoding: gap {gap:.4f} (engine prefix-cache noise {cache_noise:.4f})")
    tol = 2 * cache_noise + 0.05
    assert gap <= tol
    assert_same_greedy(text, kv, tol)


def test_injection_after_a_partial_prefix_cache_hit_stays_exact(mem):
    """Second request of a user sharing leading facts with the first: vLLM's prefix cache serves
    the shared full blocks, the connector injects the rest starting mid-block. With true-prefix
    encoding both prompts must still equal text prefill."""
    user = "partial-hit"
    ids = list(mem.add(facts=FACTS[:7], user_id=user, encode="none").ids)
    q = [{"role": "user", "content": "What is my cat called?"}]
    first_ids, second_ids = ids[:6], ids[:5] + ids[6:7]  # same first five facts, a different sixth
    for chosen in (first_ids, second_ids):
        encode_after_true_prefix(mem, user, chosen, q)
    first = mem.chat(q, user_id=user, fact_ids=first_ids, mode="kv", max_tokens=4)
    assert first.cached_tokens == 0

    second = mem.chat(q, user_id=user, fact_ids=second_ids, mode="kv", max_tokens=24)
    text = mem.chat(q, user_id=user, fact_ids=second_ids, mode="text", max_tokens=24)
    memory = mem.prompts.chat([(i, tokens(mem, mem.get(i))) for i in second_ids], q).memory_tokens
    shared = mem.prompts.chat([(i, tokens(mem, mem.get(i))) for i in ids[:5]], q).memory_tokens
    block = mem.config.engine.block_size
    assert second.cached_tokens == shared // block * block > 0
    assert second.injected_tokens == memory - second.cached_tokens
    gap = logprob_gap(text.first_logprobs, second.first_logprobs)
    print(f"\nafter a partial prefix hit ({second.cached_tokens} cached + {second.injected_tokens} injected): gap {gap:.4f}")
    assert gap <= 0.3
    assert_same_greedy(text, second, 0.3)


def test_kv_mode_prefills_its_last_facts_as_text_when_configured(mem, monkeypatch):
    """text_facts = N (kv.text_facts, or per chat) leaves the last N facts out of the injection
    plan: the engine computes them after the injected prefix. With every fact as text, KV mode is
    text prefill (only the header is injected, and it is exact). One user per setting: no
    prefix-cache sharing."""
    from dataclasses import replace

    facts = FACTS[:3]
    q = "What is the name of my cat?"
    last = len(mem.prompts.fact_tokens_many([facts[-1]])[0])
    got = {}
    for n in (0, 1, 3):
        user = f"text-facts-{n}"
        ids = list(mem.add(facts=facts, user_id=user).ids)
        if n == 1:  # from the config
            monkeypatch.setattr(mem.chats, "config", replace(mem.config, kv=replace(mem.config.kv, text_facts=n)))
            got[n] = mem.chat(q, user_id=user, fact_ids=ids, mode="kv", max_tokens=1, logprobs=20)
            monkeypatch.undo()
        else:
            got[n] = mem.chat(q, user_id=user, fact_ids=ids, mode="kv", max_tokens=1, logprobs=20, text_facts=n)
        assert got[n].fallbacks == 0 and got[n].cached_tokens == 0
    text = mem.chat(q, user_id="text-facts-3", fact_ids=ids, mode="text", max_tokens=1, logprobs=20)
    again = mem.chat(q, user_id="text-facts-3", fact_ids=ids, mode="text", max_tokens=1, logprobs=20)
    assert got[1].injected_tokens == got[0].injected_tokens - last
    assert got[3].injected_tokens == len(mem.prompts.head_ids)
    noise = logprob_gap(text.first_logprobs, again.first_logprobs)
    gaps = {n: logprob_gap(text.first_logprobs, r.first_logprobs) for n, r in got.items()}
    print(f"\ntext_facts gaps to text prefill {gaps}, noise {noise:.4f}")
    assert gaps[3] <= 2 * noise + 0.05 < gaps[0]
    with pytest.raises(InvalidInputError, match="text_facts"):
        mem.chat(q, user_id="text-facts-3", fact_ids=ids, mode="kv", max_tokens=1, text_facts=-1)


def test_facts_as_text_never_reuse_a_plain_chats_blocks(mem):
    """Over the same prompt tokens, a chat with its last fact prefilled as text holds other KV
    for it than plain injection: the prefix cache must not hand one's blocks to the other."""
    ids = list(mem.add(facts=FACTS[:4], user_id="text-facts-salt").ids)
    ask = dict(user_id="text-facts-salt", fact_ids=ids, mode="kv", max_tokens=1)
    mem.engine.reset_prefix_cache()
    assert mem.chat("What is the name of my cat?", **ask).cached_tokens == 0
    for n in (1, 2, 0):
        first = mem.chat("Where do I live?", text_facts=n, **ask)
        if n:  # the opening plain chat cached these facts' blocks: not served to a text-facts chat
            assert first.cached_tokens == 0, n
        else:  # plain shares the opening plain chat's blocks
            assert first.cached_tokens > 0
        assert mem.chat("Where do I live?", text_facts=n, **ask).cached_tokens > 0, n  # equal settings share
