"""Fact records, their scopes, and the durable store that keeps them."""

from __future__ import annotations

from pathlib import Path

from kvmem.errors import InvalidInputError
from kvmem.facts.scope import Scope
from kvmem.facts.store import FactRecord, FactStore, HistoryEvent

__all__ = ["FactRecord", "FactStore", "HistoryEvent", "Scope", "open_fact_store"]

_PG_SCHEMES = ("postgresql://", "postgres://")


def is_postgres(database_url: str | None) -> bool:
    """A PostgreSQL URL (what several processes can share: facts, leases, replica membership)."""
    return isinstance(database_url, str) and database_url.startswith(_PG_SCHEMES)


def open_fact_store(database_url: str | None, sqlite_path: Path | str) -> FactStore:
    """The PostgreSQL store at `database_url` when one is given (several processes may share it),
    else the SQLite file at `sqlite_path` (served by one process; a CLI may open it beside that one)."""
    if database_url is None:
        return FactStore(sqlite_path)
    if not is_postgres(database_url):
        raise InvalidInputError(
            f"database url must start with postgresql:// or postgres://, got {_describe(database_url)}",
            param="database_url",
        )
    from kvmem.facts.pg import PgFactStore  # psycopg is imported only by deployments that use it

    return PgFactStore(database_url)


def _describe(url: object) -> str:
    """What kind of url this is, without the rest of it: that may hold a password."""
    if not isinstance(url, str):
        return type(url).__name__
    return f"a {url.split('://', 1)[0]}:// url" if "://" in url else "no url scheme"
