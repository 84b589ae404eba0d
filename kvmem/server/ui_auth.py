"""Who is looking at the inspector page, and that its forms came from it.

A browser cannot add an `Authorization` header to a link, so the page also takes the API key
from a cookie, set by its login form: HttpOnly (no script reads it), SameSite=Strict (no other
site's page sends it) and scoped to /ui. Every form that changes something also carries a token
derived from the key and a secret of this process (HMAC), and a POST whose Origin is another
site's is refused: cross-site requests are stopped twice. The key itself is checked by the same
KeyRing as the API, so the page sees exactly what the key's tenant may see.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from fastapi import Request

from kvmem.server.errors import ApiError
from kvmem.server.tenants import Tenant

COOKIE = "kvmem_ui_key"
_SECRET = secrets.token_bytes(32)  # per process: tokens of a restarted server are re-issued on the next page


def key_of(request: Request) -> str:
    """The API key the request carries (header first, then the page's cookie); '' if none."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and key:
        return key  # untrimmed: tenant_of refuses a malformed header as the API does
    return request.cookies.get(COOKIE, "")


def tenant_of(request: Request) -> Tenant:
    """The caller's tenant, or ApiError 401 (the page shows its login form for it)."""
    key = key_of(request)
    return request.app.state.keys.tenant(f"Bearer {key}" if key else None)


def csrf_token(request: Request) -> str:
    return hmac.new(_SECRET, key_of(request).encode(), hashlib.sha256).hexdigest()


def check_form(request: Request, token: str) -> None:
    """A state-changing POST: from this origin, with this key's token; else 403."""
    origin = request.headers.get("origin")
    if origin is not None and origin not in _own_origins(request):
        raise ApiError(403, "cross-site request refused", code="forbidden")
    if not hmac.compare_digest(token or "", csrf_token(request)):
        raise ApiError(403, "the form's token is missing or stale: reload the page", code="forbidden")


def _own_origins(request: Request) -> set[str]:
    host = request.headers.get("host", "")
    return {f"http://{host}", f"https://{host}"}
