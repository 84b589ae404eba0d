"""Encodes keep their blocks after they finish, until the worker has copied their KV out (vLLM's
delayed-free protocol); then the worker reports them and vLLM gives the blocks back."""

from __future__ import annotations

from tests.helpers import tokens


def test_encode_blocks_are_given_back_once_copied(mem):
    from kvmem.encoding import salt
    from kvmem.engine.protocol import EngineRequest
    from kvmem.connector.plan import INJECT, Plan

    facts = ["Ines grows tomatoes on her balcony.", "Ines has a brother called Rui.", "Ines plays the cello."]
    result = mem.add(facts=facts, user_id="held")
    assert result.encode.encoded == 3  # three encode requests, each holding its blocks until copied
    ids = list(result.ids)
    prompt = mem.prompts.chat([(i, tokens(mem, mem.get(i))) for i in ids], [{"role": "user", "content": "Hi?"}])
    (r,) = mem.engine.run([EngineRequest(prompt.token_ids, salt("kv", "held"), max_tokens=2,
                                         plan=Plan(INJECT, prompt.segments))])
    assert r.injection.injected_segments == len(prompt.segments) and r.injection.facts_as_text == 0
    # Every encode of this session (these three and all before) was reported copied and freed.
    assert r.injection.held_for_copies == 0
