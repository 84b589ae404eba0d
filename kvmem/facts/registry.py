"""Fact records, kept in memory for now (the durable SQLite store replaces this class)."""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass

from kvmem.errors import InvalidInputError, UnknownFactError
from kvmem.kv.store import check_fact_id


@dataclass(frozen=True)
class Fact:
    id: str
    user_id: str
    text: str
    tokens: tuple[int, ...]  # the fact as rendered into prompts, tokenized on its own
    context: str = ""  # conversation that preceded the fact (Context-Window Encoding)
    context_tokens: tuple[int, ...] = ()


class FactRegistry:
    def __init__(self) -> None:
        self._facts: dict[str, Fact] = {}
        self._lock = threading.Lock()

    @staticmethod
    def new_id() -> str:
        return "f-" + uuid.uuid4().hex

    def add(self, fact: Fact) -> Fact:
        check_fact_id(fact.id)
        check_user_id(fact.user_id)
        with self._lock:
            self._facts[fact.id] = fact
        return fact

    def get(self, fact_id: str) -> Fact:
        try:
            return self._facts[fact_id]
        except KeyError:
            raise UnknownFactError(fact_id) from None

    def for_user(self, user_id: str) -> list[Fact]:
        return [f for f in self._facts.values() if f.user_id == user_id]

    def all(self) -> list[Fact]:
        return list(self._facts.values())


def check_user_id(user_id: str) -> str:
    if not isinstance(user_id, str) or not user_id.strip():
        raise InvalidInputError("user_id must be a non-empty string")
    return user_id
