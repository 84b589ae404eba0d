"""A small synthetic conversation set in LoCoMo's shape, made up here.

LoCoMo itself is CC BY-NC and lives outside this repository (read by path by the benchmarks);
the tests need only its shape: conversations with dated sessions of turns (dia ids "D<s>:<n>"),
per-session observations about each speaker citing their turns, and questions of categories 1-4
citing evidence turns, with single-hop (category 4) questions listed last as in the real file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PAIRS = {"conv-26": ("Ana", "Ben"), "conv-30": ("Clara", "Dev")}
DATES = ["1:56 pm on 8 May, 2023", "10:37 am on 27 June, 2023", "7:20 pm on 3 August, 2023"]
ACTIVITIES = [
    ("adopted", "a grey cat called Pico"), ("started", "pottery classes on Tuesdays"),
    ("visited", "her aunt in Porto"), ("bought", "a second-hand cello"), ("planted", "tomatoes on the balcony"),
    ("ran", "a half marathon in Lisbon"), ("read", "a novel about lighthouses"), ("joined", "a choir at work"),
    ("painted", "the kitchen yellow"), ("learned", "to bake sourdough bread"), ("fixed", "an old blue bicycle"),
    ("booked", "a trip to Kyoto in spring"), ("found", "a job at a small bakery"), ("moved", "to a flat near the river"),
    ("watched", "a documentary about whales"), ("cooked", "a curry for twelve friends"),
]
TURNS_PER_SESSION = 20
QUESTIONS = 60  # the first 40 of categories 1-3, then 20 single-hop (category 4)


def write(path: Path) -> Path:
    path.write_text(json.dumps([_conversation(sid, pair) for sid, pair in PAIRS.items()]))
    return path


def _conversation(sample_id: str, speakers: tuple[str, str]) -> dict:
    rng = random.Random(sample_id)
    conversation = {"speaker_a": speakers[0], "speaker_b": speakers[1]}
    observation, said = {}, []
    for s, date in enumerate(DATES, start=1):
        turns, notes = [], {name: [] for name in speakers}
        for n in range(1, TURNS_PER_SESSION + 1):
            speaker = speakers[(n - 1) % 2]
            verb, thing = rng.choice(ACTIVITIES)
            dia_id = f"D{s}:{n}"
            turns.append({"speaker": speaker, "dia_id": dia_id, "text": f"Guess what, I {verb} {thing} last week!"})
            notes[speaker].append([f"{speaker} {verb} {thing}.", dia_id])
            said.append((speaker, verb, thing, dia_id, date))
        conversation[f"session_{s}_date_time"] = date
        conversation[f"session_{s}"] = turns
        observation[f"session_{s}_observation"] = notes
    return {"sample_id": sample_id, "conversation": conversation, "observation": observation,
            "qa": [_question(i, rng.choice(said)) for i in range(QUESTIONS)]}


def _question(i: int, fact: tuple) -> dict:
    speaker, verb, thing, dia_id, date = fact
    category = 4 if i >= 40 else (1, 2, 3)[i % 3]
    if category == 2:
        return {"question": f"When did {speaker} say they {verb} {thing}?", "answer": date.split(" on ")[1],
                "evidence": [dia_id], "category": 2}
    return {"question": f"What did {speaker} say they {verb}?", "answer": thing, "evidence": [dia_id],
            "category": category}
