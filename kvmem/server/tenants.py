"""Tenants: each API key belongs to one tenant, and every scope is namespaced by its tenant.

kvmem stores user ids as f"{tenant}::{user}"; responses strip the prefix again. A user id that
contains the separator is refused, so no tenant can name another's scope, and a fact id whose
owner is another tenant answers 404 like an unknown one. With no keys configured the server is
open: one tenant, ids stored as given (so `kvmem add --user alice` and the server share them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from kvmem.errors import InvalidInputError
from kvmem.facts.text import check_unicode
from kvmem.server.errors import ApiError
from kvmem.server.ratelimit import enforce
from kvmem.server.settings import SEP


@dataclass(frozen=True)
class Tenant:
    name: str | None  # None: the open server's one tenant

    def user_id(self, user_id: object, param: str = "user_id") -> str:
        """The id kvmem stores for this tenant's `user_id` (400 naming `param` if it is unusable)."""
        if not isinstance(user_id, str) or not user_id.strip():
            raise ApiError(400, f"{param} must be a non-empty string", param=param, code="invalid_value")
        if SEP in user_id:
            raise ApiError(400, f"{param} must not contain {SEP!r}", param=param, code="invalid_value")
        try:
            check_unicode(param, user_id)
        except InvalidInputError as e:
            raise ApiError(400, str(e), param=param, code="invalid_value") from None
        return f"{self.name}{SEP}{user_id}" if self.name else user_id

    def owns(self, stored_user_id: str) -> bool:
        if self.name is None:
            return SEP not in stored_user_id
        return stored_user_id.startswith(self.name + SEP)

    def local(self, stored_user_id: str) -> str:
        return stored_user_id[len(self.name) + len(SEP):] if self.name else stored_user_id

    @property
    def anonymous(self) -> str:
        """The scope of chats without memory: no client can name it (it holds the separator)."""
        return f"{self.name or ''}{SEP}{SEP}anonymous"


class KeyRing:
    """API key -> tenant. Keys are kept as sha256 digests only."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        self._tenants = {_digest(key): tenant for key, tenant in keys.items()}

    @property
    def open(self) -> bool:
        return not self._tenants

    @property
    def tenant_names(self) -> list[str]:
        return sorted(set(self._tenants.values()))

    def tenant(self, authorization: str | None) -> Tenant:
        if self.open:
            return Tenant(None)
        if not authorization:
            raise _unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        name = self._tenants.get(_digest(bearer_key(authorization)))
        if name is None:
            raise _unauthorized("invalid API key")
        return Tenant(name)


def bearer_key(authorization: str) -> str:
    """The key of 'Bearer <key>' ("Token <key>": the scheme Mem0's client sends; the key is the
    same), or '' for another scheme (401 then).

    The scheme, one space, the key as sent: 400 for a key with whitespace around it. The key used
    to be trimmed, so 'Bearer  key' (issue 53) passed; every client sends one space, and extra
    whitespace means a key pasted or quoted wrong, which a door should say rather than mend."""
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() not in ("bearer", "token"):
        return ""
    if not key or key != key.strip():
        raise ApiError(400, "malformed Authorization header: send 'Bearer <key>', one space before the key "
                       "and none after", param="authorization", code="invalid_value",
                       headers={"WWW-Authenticate": 'Bearer error="invalid_request"'})
    return key


async def current_tenant(request: Request) -> Tenant:
    """FastAPI dependency: the caller's tenant, or 401; 429 past the tenant's request rate."""
    tenant = request.app.state.keys.tenant(request.headers.get("authorization"))
    state = request.app.state
    await run_in_threadpool(enforce, getattr(state, "rate_limiter", None), state.metrics, tenant.name)
    return tenant


CurrentTenant = Annotated[Tenant, Depends(current_tenant)]


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
