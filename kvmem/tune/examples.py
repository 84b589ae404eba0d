"""Chats to measure and train the reader on: LoCoMo questions with their retrieved facts,
tokenized piece by piece exactly as a KV-mode chat would be."""

from __future__ import annotations

from pathlib import Path

from kvmem.tune.lab import Example

ASKED = ("questions", "turns")


def from_records(prompts, records, messages: list[dict]) -> Example:
    """The Example a chat over these fact records (in prompt order) would be served as."""
    tokens = prompts.fact_tokens_many([r.text for r in records]) if records else []
    prompt = prompts.chat([(r.id, t) for r, t in zip(records, tokens)], messages)
    head = prompt.token_ids[: len(prompts.head_ids)]
    facts = tuple((prompts.context_tokens(r.context), t) for r, t in zip(records, tokens))
    return Example(head, facts, prompt.token_ids[prompt.memory_tokens :])


def locomo_examples(mem, data: Path, conversations: tuple[str, ...], *, k: int = 10, memory: str = "observations",
                    limit: int | None = None, seed: int = 0, asked: str = "questions") -> list[tuple[str, Example]]:
    """(key, Example) for each sampled message of these conversations, its facts retrieved as
    `kvmem eval locomo` retrieves (same memory, same ranking). `mem` needs no engine.

    asked="questions": LoCoMo's QA questions. asked="turns": the conversation's own turns that
    end in a question mark ("How did the race go?"), each as a user's message: more chats to
    distil from, in the conversation's voice, with no answer key needed (the teacher's reply is
    the target)."""
    if asked not in ASKED:
        raise ValueError(f"asked must be one of {ASKED}, got {asked!r}")
    from kvmem.bench import locomo
    from kvmem.bench.eval_locomo import EvalConfig, build_memory, retrieve

    cfg = EvalConfig(data=Path(data), conversations=conversations, k=k, memory=memory, limit=limit, seed=seed)
    out = []
    for conv in locomo.load(cfg.data):
        if conv["sample_id"] not in conversations:
            continue
        user = build_memory(mem, conv, cfg, encode=False)
        draw = locomo.sample_questions if asked == "questions" else locomo.turn_questions
        for i, q in draw(conv, limit, seed):
            records = retrieve(mem, user, q, cfg)
            out.append((f"{conv['sample_id']}#{'' if asked == 'questions' else 't'}{i}",
                        from_records(mem.prompts, records, [{"role": "user", "content": q["question"]}])))
    missing = set(conversations) - {key.split("#")[0] for key, _ in out}
    if missing:
        raise ValueError(f"conversations {sorted(missing)} are not in {data} (or have no questions)")
    return out

