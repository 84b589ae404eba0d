"""Context-Window Encoding: a turn encoded after its preceding turns carries what they said."""

from __future__ import annotations

import torch

CONVERSATIONS = [
    (["My sister Priya just adopted a puppy.", "She named it Mango because of its golden fur."],
     "What did my sister name her puppy?"),
    (["I started a new job at a bakery last month.", "The owner, Mr. Dupont, lets me take bread home."],
     "Who owns the bakery where I work?"),
    (["My grandfather was born in Naples.", "He moved to Boston when he was nineteen."],
     "Where did my grandfather move to?"),
    (["We adopted a cat from the shelter on Saturday.", "The kids want to call him Pepper."],
     "What do the kids want to call the cat?"),
]


def mean_gap(a: dict[int, float], b: dict[int, float]) -> float:
    common = a.keys() & b.keys()
    return sum(abs(a[t] - b[t]) for t in common) / len(common)


def test_window_changes_the_stored_kv_and_brings_injection_closer_to_full_text(mem):
    gaps = {0: [], 2: []}
    agree = {0: 0, 2: 0}
    for n, (turns, question) in enumerate(CONVERSATIONS):
        messages = [{"role": "user", "content": t} for t in turns]
        blobs = {}
        for window in (0, 2):
            user = f"cwe-{n}-w{window}"
            ids = mem.add(messages, user_id=user, window=window).ids
            blobs[window] = mem.kv.get(ids[1])
            # Reference: both turns prefilled as text. Candidate: only the second turn, as KV.
            full = mem.chat(question, user_id=user, fact_ids=list(ids), mode="text", max_tokens=4)
            kv = mem.chat(question, user_id=user, fact_ids=[ids[1]], mode="kv", max_tokens=4)
            gaps[window].append(mean_gap(full.first_logprobs, kv.first_logprobs))
            agree[window] += max(full.first_logprobs, key=full.first_logprobs.get) == max(kv.first_logprobs, key=kv.first_logprobs.get)
        assert blobs[0].token_ids == blobs[2].token_ids
        assert not torch.allclose(blobs[0].key, blobs[2].key, atol=1e-2)  # the window shaped the KV
    mean = {w: sum(g) / len(g) for w, g in gaps.items()}
    print(f"\nCWE: mean |logprob gap| to full-text prefill of the window (top-20, first token): "
          f"window 0 {mean[0]:.3f}, window 2 {mean[2]:.3f}; top-1 agreement w0 {agree[0]}/4, w2 {agree[2]}/4; "
          f"per conversation w0 {[round(g, 3) for g in gaps[0]]} w2 {[round(g, 3) for g in gaps[2]]}")
    assert mean[2] < mean[0]
