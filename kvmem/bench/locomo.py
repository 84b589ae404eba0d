"""Reading LoCoMo by path (CC BY-NC: never copied into this repository), and the synthetic
LoCoMo-shaped set kvmem ships in its place."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from kvmem.errors import InvalidInputError
from kvmem.facts import messages

DEFAULT_PATH = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "locomo" / "locomo_dev.json"
# The synthetic tuning set kvmem ships (package data of kvmem.tune, written by kvmem/tune/tuning_set.py:
# made-up conversations in LoCoMo's shape, no outside data). `bench ttft` and `bench load` read it
# when given no --data, `tune-reader` trains on it. Located here, below kvmem.tune in the layers,
# so that the benches reach it without importing upward.
SYNTHETIC_PATH = Path(__file__).resolve().parents[1] / "tune" / "data" / "tuning_set.json"
SYNTHETIC, LOCOMO = "synthetic", "locomo"


@dataclass(frozen=True)
class Observation:
    text: str
    speaker: str
    session: int
    date: str
    dia_ids: tuple[str, ...] = ()


def load(path: Path | str = DEFAULT_PATH) -> list[dict]:
    return json.loads(_found(Path(path)).read_text())


def bench_data(path: Path | str | None) -> tuple[Path, str]:
    """(file, which set: SYNTHETIC or LOCOMO) a bench reads: the synthetic set kvmem ships when no
    path is given, else that file, checked now (a missing one is an error naming it, never a
    fallback to the synthetic set)."""
    if path is None:
        return SYNTHETIC_PATH, SYNTHETIC
    path = _found(Path(path))
    return path, SYNTHETIC if path.resolve() == SYNTHETIC_PATH else LOCOMO


def describe_data(which: str, path: Path | str) -> str:
    """One line for a bench's output: which data its figures come from."""
    if which == SYNTHETIC:
        return (f"data: the synthetic tuning set kvmem ships ({path}), not LoCoMo: figures are not comparable "
                "with the README's; pass --data PATH to read LoCoMo")
    return f"data: LoCoMo ({path})"


def _found(path: Path) -> Path:
    if not path.is_file():
        raise InvalidInputError(
            f"LoCoMo data not found at {path}. kvmem does not ship it (CC BY-NC): download locomo10.json "
            "from the LoCoMo repository (snap-research/locomo on GitHub) and pass --data PATH", param="path")
    return path


def observations(conversation: dict) -> list[Observation]:
    """Atomic facts about each speaker, in session order, each with its session's date."""
    conv, out = conversation["conversation"], []
    for key, per_speaker in sorted(conversation["observation"].items(), key=lambda kv: _session(kv[0])):
        n = _session(key)
        for speaker, items in per_speaker.items():
            out += [Observation(text, speaker, n, conv.get(f"session_{n}_date_time", ""), _dia_ids(src))
                    for text, src in items]
    return out


def sessions(conversation: dict) -> list[tuple[int, list[dict], str]]:
    """(session number, turns, date) in order; only `session_<N>` keys that hold turns."""
    conv = conversation["conversation"]
    keys = [k for k in conv if k.startswith("session_") and k.split("_")[1].isdigit() and isinstance(conv[k], list)]
    return [(_session(k), conv[k], conv.get(f"{k}_date_time", "")) for k in sorted(keys, key=_session)]


def turns_before(conversation: dict, dia_ids: tuple[str, ...], window: int) -> list[tuple[dict, str]]:
    """The `window` turns ending at the earliest of `dia_ids` (inclusive), with their session date.

    An observation restates what was said in those turns: they are the conversation that
    preceded it, which Context-Window Encoding encodes it after. Unknown ids give [].
    """
    order = [(t, date) for _, turns, date in sessions(conversation) for t in turns]
    where = {t.get("dia_id"): i for i, (t, _) in enumerate(order)}
    found = [where[d] for d in dia_ids if d in where]
    if not found or window <= 0:
        return []
    end = min(found) + 1
    return order[max(0, end - window) : end]


def observation_context(conversation: dict, o: Observation, window: int, fact_template: str) -> str:
    """Context-Window Encoding for an observation: the `window` turns ending at its evidence, rendered
    as a turn fact's context is (`fact_template` per turn). Window 1 is the turn it restates."""
    return "".join(fact_template.format(text=messages.turn_text(message(conversation, t, date)))
                   for t, date in turns_before(conversation, o.dia_ids, window))


def message(conversation: dict, turn: dict, date: str) -> dict:
    """A turn as a chat message for `KVMem.add`: the first speaker is the user."""
    speaker_a = conversation["conversation"]["speaker_a"]
    return {"role": "user" if turn["speaker"] == speaker_a else "assistant", "name": turn["speaker"],
            "content": turn_text(turn), "timestamp": date}


def turn_text(turn: dict) -> str:
    caption = f" [shares {turn['blip_caption']}]" if turn.get("blip_caption") else ""
    return f"{turn['text']}{caption}".strip() or caption.strip()


def _dia_ids(src) -> tuple[str, ...]:
    items = src if isinstance(src, list) else [src]
    return tuple(i.strip() for s in items for i in str(s).replace(";", ",").split(",") if i.strip())


def questions(conversation: dict, categories=(1, 2, 3, 4)) -> list[dict]:
    return [q for q in conversation["qa"] if q.get("category") in categories and "answer" in q]


def sample_questions(conversation: dict, limit: int | None, seed: int = 0) -> list[tuple[int, dict]]:
    """(index, question) pairs: all questions, or `limit` of them drawn at random, in file order.

    LoCoMo lists a conversation's questions roughly by category (single-hop, category 4, last),
    so its first N questions would leave out the most common category.
    """
    return _draw(list(enumerate(questions(conversation))), limit, f"{seed}:{conversation['sample_id']}")


def turn_questions(conversation: dict, limit: int | None, seed: int = 0) -> list[tuple[int, dict]]:
    """(turn number across sessions, {"question": text}) for the turns ending in "?", all or
    `limit` of them drawn at random, in conversation order."""
    turns = [t for _, ts, _ in sessions(conversation) for t in ts]
    asked = [(i, {"question": t["text"].strip()}) for i, t in enumerate(turns) if t.get("text", "").strip().endswith("?")]
    return _draw(asked, limit, f"{seed}:{conversation['sample_id']}:turns")


def _draw(numbered: list[tuple[int, dict]], limit: int | None, key: str) -> list[tuple[int, dict]]:
    """All of `numbered`, or `limit` of them drawn with a generator seeded by `key`, in order."""
    if not limit or limit >= len(numbered):
        return numbered
    return sorted(random.Random(key).sample(numbered, limit), key=lambda pair: pair[0])


def _session(key: str) -> int:
    return int(key.split("_")[1])
