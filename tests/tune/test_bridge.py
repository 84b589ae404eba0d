"""Learned bridge tokens in the lab: the soft-token path is the token path, and training moves
KV mode toward text prefill on what it trained on."""

from __future__ import annotations

import dataclasses

import torch

from kvmem.tune import bridge
from kvmem.tune.lab import memory_cache, reply_logits, teacher_reply
from kvmem.tune.measure import kl_per_token


@torch.no_grad()
def test_no_bridge_tokens_is_kv_mode(hf_model, make_example):
    ex = make_example()
    reply = ex.tail[-3:]  # any tokens: teacher-forced
    layers = memory_cache(hf_model, ex)
    empty = torch.zeros(0, hf_model.config.hidden_size)
    torch.testing.assert_close(bridge.bridged_logits(hf_model, ex, reply, layers, empty),
                               reply_logits(hf_model, ex, reply, layers), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_bridge_vectors_that_are_token_embeddings_read_as_those_tokens(hf_model, make_example, prompts):
    """Soft tokens equal to the embeddings of real tokens give what prefilling those tokens
    between the facts and the tail gives: positions, cache and slicing line up."""
    ex = make_example()
    words = tuple(prompts.tokenizer.encode(" Remember these.\n", add_special_tokens=False))
    reply = ex.tail[-3:]
    layers = memory_cache(hf_model, ex)
    soft = hf_model.get_input_embeddings()(torch.tensor(words))  # [B, hidden]
    as_tokens = dataclasses.replace(ex, tail=words + ex.tail)
    torch.testing.assert_close(bridge.bridged_logits(hf_model, ex, reply, layers, soft),
                               reply_logits(hf_model, as_tokens, reply, layers), rtol=1e-4, atol=1e-4)


def test_training_lowers_the_kl_it_trains_on(hf_model, make_example, eos, prompts):
    examples = [make_example(), make_example(question="Where did I go camping?")]
    targets = [teacher_reply(hf_model, ex, 4, eos) for ex in examples]
    memory = bridge.Memory(hf_model, None)
    newline = prompts.tokenizer.encode("\n", add_special_tokens=False)[-1]
    init = bridge.initial(hf_model, newline, 4)
    learned, losses = bridge.train(hf_model, examples, targets, memory, init,
                                   bridge.BridgeConfig(tokens=4, lr=3e-2, epochs=6), progress=False)

    def kl(b):
        with torch.no_grad():
            return sum(kl_per_token(t, bridge.bridged_logits(hf_model, ex, r, memory(ex), b)).mean().item()
                       for ex, (r, t) in zip(examples, targets))

    assert learned.shape == init.shape and not torch.equal(learned, init)
    assert kl(learned) < 0.7 * kl(init), (kl(init), kl(learned))
    assert all(not p.requires_grad for p in hf_model.parameters())  # the model stays frozen
