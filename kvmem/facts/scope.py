"""Who a fact belongs to: a user, optionally narrowed to one agent and one run (as in Mem0).

Ids are opaque: they are compared exactly, never stripped or case-folded, so "alice" and
"alice " are two users. `key` is the one string the store indexes a scope by.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvmem.errors import InvalidInputError
from kvmem.facts.text import check_unicode


def check_scope_field(name: str, value: object, *, required: bool) -> str | None:
    """`value` if it is a usable id for field `name`, else InvalidInputError naming the field."""
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        need = "a non-empty string" if required else "None or a non-empty string"
        raise InvalidInputError(f"{name} must be {need}, got {value!r}", param=name)
    return check_unicode(name, value)


@dataclass(frozen=True)
class Scope:
    user_id: str
    agent_id: str | None = None
    run_id: str | None = None

    def __post_init__(self) -> None:
        check_scope_field("user_id", self.user_id, required=True)
        check_scope_field("agent_id", self.agent_id, required=False)
        check_scope_field("run_id", self.run_id, required=False)

    @property
    def key(self) -> str:
        # JSON quoting keeps any character in an id from forging another scope's key.
        return json.dumps([self.user_id, self.agent_id, self.run_id], ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_key(cls, key: str) -> Scope:
        """The scope whose `key` this is."""
        user_id, agent_id, run_id = json.loads(key)
        return cls(user_id, agent_id, run_id)
