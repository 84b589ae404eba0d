"""Who is calling an MCP tool: a tenant (from the API key) and a scope (from the connection).

An agent never names a user in a tool's arguments: the scope is fixed where the connection is
configured (`kvmem mcp --user`, or the X-Kvmem-User-Id header of an HTTP connection), and the
tenant comes from the key, so a tool can reach neither another user's nor another tenant's memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from kvmem.facts.scope import Scope

HEADERS = {"user_id": "x-kvmem-user-id", "agent_id": "x-kvmem-agent-id", "run_id": "x-kvmem-run-id"}


class Tenancy(Protocol):
    """A tenant as the HTTP server has it (kvmem.server.tenants.Tenant): how its user ids are stored."""

    name: str | None

    def user_id(self, user_id: object, param: str = "user_id") -> str: ...

    def owns(self, stored_user_id: str) -> bool: ...

    def local(self, stored_user_id: str) -> str: ...


# The caller's tenant from an Authorization header; raises (with `code`) for a missing or unknown key.
TenantOf = Callable[[str | None], Tenancy]


class CallerError(Exception):
    """The connection is not configured to reach any memory: no user, or an unusable id."""

    def __init__(self, message: str, *, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class Caller:
    tenant: Tenancy
    scope: Scope  # its user_id as stored: tenant-prefixed

    @classmethod
    def of(cls, tenant: Tenancy, user_id: str | None, agent_id: str | None = None,
           run_id: str | None = None) -> "Caller":
        """The caller of `tenant` scoped to these ids as the connection gave them (not yet prefixed)."""
        if not user_id:
            raise CallerError("the connection names no user: set X-Kvmem-User-Id (HTTP) or --user (stdio)",
                              param="user_id")
        return cls(tenant, Scope(tenant.user_id(user_id), agent_id or None, run_id or None))

    def holds(self, record) -> bool:
        """Whether a stored fact lies inside this caller's scope (its tenant, user, and agent/run if set)."""
        s = self.scope
        return self.is_user(record.user_id) and s.agent_id in (None, record.agent_id) and s.run_id in (
            None, record.run_id)

    def is_user(self, stored_user_id: str | None) -> bool:
        """Whether a stored user id is this caller's (of its tenant, and its user)."""
        return stored_user_id == self.scope.user_id and self.tenant.owns(stored_user_id)

    @property
    def ids(self) -> dict:
        """The scope as KVMem's keyword arguments."""
        return {"user_id": self.scope.user_id, "agent_id": self.scope.agent_id, "run_id": self.scope.run_id}


def from_headers(headers: Mapping[str, str] | None, tenant_of: TenantOf) -> Caller:
    """The caller an HTTP request names: the tenant of its Authorization header, the scope of its
    X-Kvmem-*-Id headers."""
    headers = {k.lower(): v for k, v in (headers or {}).items()}
    tenant = tenant_of(headers.get("authorization"))
    return Caller.of(tenant, **{field: headers.get(name) for field, name in HEADERS.items()})
