"""The tuning set kvmem ships: synthetic personal-memory conversations in LoCoMo's shape.

`kvmem tune-reader` trains a model's reader map on chats over stored facts; it needs
conversations, the facts they hold and questions about them. LoCoMo has them but may not be
redistributed (CC BY-NC), so this module writes its own, from templates made up here: pairs of
friends talk over dated sessions about pets, work, travel, hobbies, health, family, homes, food,
sport, study, purchases, reading, volunteering and plans; each speaker's facts are restated as
observations citing their turns, and questions ask about them (single-hop, temporal and two-fact
questions, LoCoMo's categories 4, 2 and 1). Topics, names, session counts and lengths vary per
conversation, drawn from a seeded generator: the same seed writes the same file.

The file ships as package data (kvmem/tune/data/tuning_set.json, written by `write()`;
tests/tune/test_tuning_set.py checks it equals what this module generates), so a fresh install
can tune a map for any model with no outside data:

    .venv/bin/python -m kvmem.tune.tuning_set   # rewrites the shipped file
"""

from __future__ import annotations

import json
import random
from datetime import date, timedelta
from pathlib import Path

from kvmem.bench.locomo import SYNTHETIC_PATH

PATH = SYNTHETIC_PATH  # located in kvmem.bench.locomo, where the benches (a layer below) read it too
CONVERSATIONS = 16
SEED = 0

NAMES = ["Amara", "Bruno", "Chloe", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kavya", "Leo",
         "Maya", "Nikolai", "Olivia", "Pedro", "Quinn", "Rosa", "Sami", "Tessa", "Umar", "Vera", "Wen", "Yusuf",
         "Zoe", "Aiden", "Bea", "Carlos", "Dana", "Emil", "Fatima", "Gus"]

# Slot values; a template names them in braces.
SLOTS = {
    "animal": ["cat", "dog", "rabbit", "parrot", "tortoise", "hamster"],
    "pet": ["Pico", "Biscuit", "Luna", "Mochi", "Captain", "Olive", "Ziggy", "Pepper"],
    "job": ["nurse", "data analyst", "carpenter", "teacher", "sound engineer", "pharmacist", "architect"],
    "company": ["a small bakery", "the city hospital", "a robotics startup", "the public library",
                "a design studio", "an insurance firm"],
    "city": ["Lisbon", "Kyoto", "Montreal", "Nairobi", "Oslo", "Buenos Aires", "Hanoi", "Edinburgh"],
    "month": ["March", "April", "June", "August", "October", "December"],
    "reason": ["a friend's wedding", "a conference", "a hiking trip", "my cousin's graduation", "a food festival"],
    "instrument": ["cello", "ukulele", "piano", "drums", "violin", "flute"],
    "weekday": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
    "food": ["sugar", "coffee", "salt", "red meat", "fried food"],
    "condition": ["blood pressure", "cholesterol", "sleep problems", "back pain"],
    "relative": ["sister", "brother", "cousin", "aunt", "best friend"],
    "rname": ["Alex", "Sam", "Robin", "Kim", "Jo", "Charlie", "Noor", "Ari"],
    "place": ["a vineyard", "the old town hall", "a beach in Crete", "a barn outside the city", "a lake house"],
    "district": ["the riverside", "the old quarter", "the north hills", "the harbour"],
    "landmark": ["botanical garden", "train station", "football stadium", "lighthouse"],
    "dish": ["lentil curry", "mushroom risotto", "fish tacos", "ramen", "shakshuka", "dumplings"],
    "race": ["city half marathon", "10k charity run", "trail race", "harbour swim"],
    "minutes": ["52", "97", "115", "68", "44"],
    "subject": ["astronomy", "Spanish", "pottery", "web design", "first aid", "photography"],
    "colour": ["blue", "green", "red", "yellow", "black"],
    "item": ["bicycle", "armchair", "sewing machine", "camera", "kayak", "record player"],
    "price": ["40", "85", "120", "15", "200"],
    "book": ["a novel about lighthouse keepers", "a history of the silk road", "a memoir by a mountain guide",
             "a thriller set in Venice", "a guide to growing vegetables"],
    "org": ["animal shelter", "food bank", "youth football club", "hospice", "community garden"],
    "plant": ["tomatoes", "basil", "sunflowers", "strawberries", "chillies"],
    "car": ["old van", "car", "scooter", "motorbike"],
    "plan": ["open a small cafe", "walk the Camino de Santiago", "learn to sail", "run a marathon",
             "write a children's book"],
}

# (topic, what the speaker says, the observation, the question and the slot that answers it).
# The temporal question of each fact is asked from its observation's verb phrase.
FACTS = [
    ("pets", "Guess what, I adopted a {animal} and named it {pet}!", "{name} adopted a {animal} named {pet}.",
     "What is the name of {name}'s {animal}?", "pet", "adopt a {animal}"),
    ("work", "I just started a new job as a {job} at {company}.", "{name} started working as a {job} at {company}.",
     "What job did {name} start?", "job", "start the new job as a {job}"),
    ("travel", "We're flying to {city} in {month} for {reason}.", "{name} is travelling to {city} in {month} for "
     "{reason}.", "Where is {name} travelling in {month}?", "city", "plan the trip to {city}"),
    ("hobbies", "I've been taking {instrument} lessons every {weekday}.", "{name} takes {instrument} lessons on "
     "{weekday}s.", "Which instrument is {name} learning?", "instrument", "start {instrument} lessons"),
    ("health", "My doctor told me to cut down on {food} because of my {condition}.", "{name} was told to cut down "
     "on {food} because of {condition}.", "What did {name}'s doctor tell them to cut down on?", "food",
     "see the doctor about {condition}"),
    ("family", "My {relative} {rname} is getting married at {place}!", "{name}'s {relative} {rname} is getting "
     "married at {place}.", "Where is {name}'s {relative} getting married?", "place",
     "hear about the wedding of {rname}"),
    ("home", "We finally moved into a flat in {district}, right by the {landmark}.", "{name} moved to a flat in "
     "{district} near the {landmark}.", "Which part of town did {name} move to?", "district",
     "move to {district}"),
    ("food", "Lately I cook {dish} every {weekday}, it's my favourite.", "{name}'s favourite dish lately is {dish}.",
     "What is {name}'s favourite dish lately?", "dish", "start cooking {dish}"),
    ("sport", "I finished the {race} in {minutes} minutes!", "{name} finished the {race} in {minutes} minutes.",
     "How long did {name} take to finish the {race}?", "minutes", "run the {race}"),
    ("study", "I enrolled in an evening course on {subject}.", "{name} enrolled in an evening course on {subject}.",
     "What evening course did {name} enrol in?", "subject", "enrol in the {subject} course"),
    ("purchases", "I bought a {colour} {item} second-hand for {price} euros.", "{name} bought a second-hand "
     "{colour} {item} for {price} euros.", "What did {name} buy second-hand?", "item", "buy the {item}"),
    ("reading", "I'm reading {book} and can't put it down.", "{name} is reading {book}.",
     "What book is {name} reading?", "book", "start reading {book}"),
    ("volunteering", "I volunteer at the {org} every {weekday} now.", "{name} volunteers at the {org} on "
     "{weekday}s.", "Where does {name} volunteer?", "org", "start volunteering at the {org}"),
    ("garden", "I planted {plant} on the balcony this week.", "{name} planted {plant} on the balcony.",
     "What did {name} plant on the balcony?", "plant", "plant {plant}"),
    ("mishaps", "My {car} broke down on the way to {city}.", "{name}'s {car} broke down on the way to {city}.",
     "What broke down on {name}'s way to {city}?", "car", "break down on the way to {city}"),
    ("plans", "One day I really want to {plan}.", "{name} dreams of being able to {plan}.",
     "What does {name} dream of doing one day?", "plan", "talk about wanting to {plan}"),
]

REPLIES = ["That's wonderful, tell me more!", "Oh wow, I didn't know that.", "How exciting!",
           "That sounds like a lot of work.", "I'm so happy for you.", "Really? How did that happen?",
           "Ha, that's so you.", "You have to send me pictures."]
SMALL_TALK = [("Hey! How have you been?", "Pretty good, busy week. You?"),
              ("Long time no talk! What's new?", "Oh, quite a lot actually."),
              ("Good morning! Did you sleep well?", "Not really, but the coffee is helping."),
              ("Hi! Sorry I missed your call.", "No worries, I wanted to catch up.")]
GOODBYES = [("I have to run, talk soon!", "Bye, take care!"), ("Let's catch up again next week.", "Definitely!")]


def generate(n: int = CONVERSATIONS, seed: int = SEED) -> list[dict]:
    """`n` conversations ("syn-01", ...) in LoCoMo's JSON shape (kvmem/bench/locomo.py reads it)."""
    rng = random.Random(seed)
    names = rng.sample(NAMES, 2 * n)
    return [_conversation(f"syn-{i + 1:02d}", (names[2 * i], names[2 * i + 1]), random.Random(f"{seed}:{i}"))
            for i in range(n)]


def _conversation(sample_id: str, speakers: tuple[str, str], rng: random.Random) -> dict:
    conv = {"speaker_a": speakers[0], "speaker_b": speakers[1]}
    observation, told = {}, []  # told: (speaker, fact template, slots, dia id, date)
    day = date(2024, 1, 8) + timedelta(days=rng.randrange(300))
    topics = {s: [] for s in speakers}  # each speaker's own order; a topic comes back only once all have
    for s in range(1, rng.randint(4, 9) + 1):
        day += timedelta(days=rng.randint(3, 40))
        stamp = f"{rng.randint(1, 11)}:{rng.choice(['05', '20', '37', '52'])} {rng.choice(['am', 'pm'])} on " \
                f"{day.day} {day.strftime('%B')}, {day.year}"
        turns, notes = [], {name: [] for name in speakers}

        def say(speaker: str, text: str) -> str:
            dia_id = f"D{s}:{len(turns) + 1}"
            turns.append({"speaker": speaker, "dia_id": dia_id, "text": text})
            return dia_id

        hello, answer = rng.choice(SMALL_TALK)
        say(speakers[0], hello)
        say(speakers[1], answer)
        for _ in range(rng.randint(3, 8)):
            speaker = rng.choice(speakers)
            topics[speaker] = topics[speaker] or rng.sample(FACTS, len(FACTS))
            fact = topics[speaker].pop()
            slots = {k: rng.choice(v) for k, v in SLOTS.items()}
            dia_id = say(speaker, fact[1].format(**slots))
            notes[speaker].append([fact[2].format(name=speaker, **slots), dia_id])
            told.append((speaker, fact, slots, dia_id, stamp))
            say(speakers[1] if speaker == speakers[0] else speakers[0], rng.choice(REPLIES))
        bye, back = rng.choice(GOODBYES)
        say(speakers[1], bye)
        say(speakers[0], back)
        conv[f"session_{s}_date_time"] = stamp
        conv[f"session_{s}"] = turns
        observation[f"session_{s}_observation"] = notes
    return {"sample_id": sample_id, "conversation": conv, "observation": observation, "qa": _questions(told, rng)}


def _questions(told: list[tuple], rng: random.Random) -> list[dict]:
    """Per fact a single-hop question (category 4), every other fact a temporal one (2), and
    two-fact questions over pairs of one speaker's facts (1); single-hop listed last, as LoCoMo does."""
    single, temporal, multi = [], [], []
    for i, (speaker, fact, slots, dia_id, stamp) in enumerate(told):
        single.append({"question": fact[3].format(name=speaker, **slots), "answer": slots[fact[4]],
                       "evidence": [dia_id], "category": 4})
        if i % 2 == 0:
            temporal.append({"question": f"When did {speaker} {fact[5].format(**slots)}?",
                             "answer": stamp.split(" on ")[1], "evidence": [dia_id], "category": 2})
    for a, b in zip(told, told[1:]):
        if a[0] == b[0]:
            multi.append({"question": f"{a[1][3].format(name=a[0], **a[2])[:-1]}, and "
                                      f"{b[1][3].format(name=b[0], **b[2])[0].lower()}"
                                      f"{b[1][3].format(name=b[0], **b[2])[1:]}",
                          "answer": f"{a[2][a[1][4]]}; {b[2][b[1][4]]}", "evidence": [a[3], b[3]], "category": 1})
    return multi + temporal + single


def write(path: Path = PATH) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(generate(), ensure_ascii=False) + "\n")
    return path


if __name__ == "__main__":
    print(write())
