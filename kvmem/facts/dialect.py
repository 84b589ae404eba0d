"""What a database must provide for FactStore's shared SQL: a Connection, and a Dialect for the rest.

The SQL (store.py, sql.py) is written once, with `?` and `:name` placeholders, and runs unchanged
on both databases. What cannot be written once lives behind `Dialect`: opening the connection
and its schema, the write lock a transaction takes, the change feed, and what a delete must do
after its commit so the words are really gone. sqlite.py and pg.py are the two dialects.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol


class Connection(Protocol):
    """sqlite3's connection, or pg.py's psycopg adapter: `?`/`:name` placeholders, autocommit
    (writes send BEGIN and COMMIT themselves), rows readable by column name and by index."""

    @property
    def in_transaction(self) -> bool: ...

    def execute(self, sql: str, params: Any = ..., /) -> Any: ...

    def executemany(self, sql: str, params: Iterable[Any], /) -> Any: ...

    def close(self) -> None: ...


class Dialect(Protocol):
    """One database under FactStore. FactStore calls every method but `stop_feeds` with its lock held."""

    where: str  # the store as messages name it: a path, or a url without its password

    def connect(self) -> Connection:
        """A connection with the schema in place (created or migrated), or KvmemError."""
        ...

    def begin(self, conn: Connection) -> None:
        """Start a write transaction that holds the writers' lock from the start, so the reads a
        write makes first (the dedupe check) stay true until its commit."""
        ...

    def changed(self, conn: Connection, op: str, fact: Mapping[str, Any] | None) -> None:
        """Inside the write transaction, once per fact it adds, updates or deletes (op "add",
        "update", "delete"; `fact` has "id" and "user_id"), or once with None for "reset"."""
        ...

    def forgotten(self, conn: Connection) -> None:
        """After a commit that deleted facts: push the deleted text out of whatever still holds it."""
        ...

    def subscribe(self, callback: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
        """FactStore.subscribe's feed (see there); returns the function that stops it."""
        ...

    def stop_feeds(self) -> None:
        """Stop every feed `subscribe` started. Called without the store's lock: a feed's callback
        may be waiting for that lock."""
        ...

    def close(self, conn: Connection) -> None:
        """Close `conn` for good (the store is closing)."""
        ...
