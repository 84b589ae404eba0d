"""/ui: the memory inspector, server-rendered (ui_pages.py), behind the API's keys (ui_auth.py).

Scopes with fact counts and KV bytes; a scope's facts, pageable, and a search showing the hybrid
score beside the dense and lexical ones; a fact with its blob (tier, bytes, codec, uses) and
history; forgetting a fact or a scope after a confirmation; a chat's x-ray (trace.py); and a
playground asking one question in KV mode and text mode side by side. Off with [server] ui = false.
"""

from __future__ import annotations

import json
from urllib.parse import parse_qs, urlencode

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from kvmem.errors import UnknownFactError
from kvmem.facts.store import MAX_OFFSET
from kvmem.server.errors import ApiError
from kvmem.server.tenants import SEP, Tenant
from kvmem.server.ui_auth import COOKIE, check_form, csrf_token, tenant_of
from kvmem.server.ui_pages import CSP, STYLE, render, when

router = APIRouter(prefix="/ui", include_in_schema=False)
PAGE = 50  # facts per page
_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin",
            "Cache-Control": "no-store", "X-Frame-Options": "DENY"}


class _Login(Exception):
    """No key, or not a valid one: the login form, with 401."""


class _Page(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def install(app: FastAPI) -> None:
    async def login(request: Request, exc: _Login) -> Response:
        return _html(render("login", title="Log in", message=str(exc)), 401)

    async def page(request: Request, exc: _Page) -> Response:
        return _html(render("error", title=str(exc.status), status=exc.status, message=exc.message), exc.status)

    app.add_exception_handler(_Login, login)
    app.add_exception_handler(_Page, page)
    app.include_router(router)


def _html(body: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(body, status_code=status, headers=_HEADERS)


class _View:
    """One request's tenant, KVMem and the values every page shows."""

    def __init__(self, request: Request) -> None:
        try:
            self.tenant: Tenant = tenant_of(request)
        except ApiError as e:
            raise _Login("" if e.message.startswith("missing") else "That key is not valid.") from None
        try:
            self.mem = request.app.state.runtime.require()
        except ApiError as e:
            raise _Page(e.status, e.message) from None
        self.rt, self.request = request.app.state.runtime, request
        self.common = {"tenant": self.tenant.name or "", "csrf": csrf_token(request)}

    def page(self, name: str, title: str, **values) -> HTMLResponse:
        return _html(render(name, title=title, **self.common, **values))

    def fact(self, fact_id: str):
        """The tenant's fact, or a 404 page (another tenant's looks the same as none)."""
        try:
            record = self.mem.get(fact_id)
        except UnknownFactError:
            record = None
        if record is None or not self.tenant.owns(record.user_id):
            raise _Page(404, "no such fact")
        return record

    def scope(self, fields: dict) -> dict:
        user = fields.get("user")
        if not user:
            raise _Page(400, "which user?")
        try:
            user_id = self.tenant.user_id(user)
        except ApiError as e:
            raise _Page(400, e.message) from None
        return {"user_id": user_id, "agent_id": fields.get("agent") or None, "run_id": fields.get("run") or None}

    async def form(self) -> dict:
        fields = {k: v[-1] for k, v in parse_qs((await self.request.body()).decode("utf-8", "replace")).items()}
        try:
            check_form(self.request, fields.get("csrf", ""))
        except ApiError as e:
            raise _Page(e.status, e.message) from None
        return fields


def _scope_href(user: str, agent: str | None, run: str | None, **extra) -> str:
    fields = {"user": user, **({"agent": agent} if agent else {}), **({"run": run} if run else {}), **extra}
    return "/ui/scope?" + urlencode(fields)


def _scope_fields(request_fields) -> list[tuple[str, str]]:
    return [(k, request_fields[k]) for k in ("user", "agent", "run") if request_fields.get(k)]


@router.get("/style.css")
async def style() -> Response:
    return Response(STYLE, media_type="text/css", headers={"Cache-Control": "max-age=3600"})


@router.get("/login")
async def login_page() -> HTMLResponse:
    return _html(render("login", title="Log in", message=""))


@router.post("/login")
async def login(request: Request) -> Response:
    key = (parse_qs((await request.body()).decode("utf-8", "replace")).get("key") or [""])[-1].strip()
    origin = request.headers.get("origin")
    if origin is not None and origin.split("://")[-1] != request.headers.get("host"):
        raise _Page(403, "cross-site request refused")
    try:
        request.app.state.keys.tenant(f"Bearer {key}" if key else None)
    except ApiError:
        return _html(render("login", title="Log in", message="That key is not valid."), 401)
    out = RedirectResponse("/ui", status_code=303)
    out.set_cookie(COOKIE, key, httponly=True, samesite="strict", path="/ui",
                   secure=request.url.scheme == "https")
    return out


@router.post("/logout")
async def logout(request: Request) -> Response:
    await _View(request).form()
    out = RedirectResponse("/ui/login", status_code=303)
    out.delete_cookie(COOKIE, path="/ui")
    return out


@router.get("")
async def scopes(request: Request) -> HTMLResponse:
    v = _View(request)
    prefix = f"{v.tenant.name}{SEP}" if v.tenant.name else ""  # the tenant's users only, in SQL
    groups = [s for s in await v.rt.call(v.mem.scopes, prefix) if v.tenant.owns(s.user_id)]
    shown = [{"user": v.tenant.local(user), "agent": agent, "run": run, "facts": n, "kv_bytes": size,
              "href": _scope_href(v.tenant.local(user), agent, run)} for (user, agent, run), (n, size) in _rows(groups)]
    return v.page("scopes", "Scopes", scopes=shown)


def _rows(groups) -> list[tuple[tuple, tuple[int, int]]]:
    """A row per user (all its facts) and per agent/run within it, each counting what its link
    opens (and what forgetting it forgets): a scope left out means any, as in get_all/delete_all."""
    keys = sorted({(g.user_id, None, None) for g in groups} | {(g.user_id, g.agent_id, g.run_id) for g in groups},
                  key=lambda k: (k[0], k[1] or "", k[2] or ""))
    out = []
    for user, agent, run in keys:
        inside = [g for g in groups if g.user_id == user and agent in (None, g.agent_id) and run in (None, g.run_id)]
        out.append(((user, agent, run), (sum(g.facts for g in inside), sum(g.kv_bytes for g in inside))))
    return out


@router.get("/scope")
async def scope(request: Request) -> HTMLResponse:
    v = _View(request)
    q = request.query_params
    sc = v.scope(dict(q))
    offset = _offset(q.get("offset", "0"))
    records = await v.rt.call(v.mem.get_all, **sc, limit=PAGE + 1, offset=offset)
    last = _last_injected(v.mem.recent_chats(sc["user_id"]))
    facts = []
    for r in records[:PAGE]:
        blob = await v.rt.call(v.mem.blob, r.id)
        facts.append({"id": r.id, "text": r.text, "origin": r.origin, "metadata": json.dumps(r.metadata, ensure_ascii=False) if r.metadata else "",
                      "created": when(r.created_at), "kv_status": r.kv_status, "tier": blob.tier, "bytes": blob.bytes,
                      "codec": blob.codec, "uses": blob.uses, "last_injected": when(last.get(r.id))})
    user, agent, run = q.get("user"), q.get("agent"), q.get("run")
    hits = await _hits(v, q.get("q", "").strip(), sc)
    total = await v.rt.call(lambda: v.mem.count(**sc))
    return v.page("scope", f"Scope {user}", label=_label(user, agent, run), q=q.get("q", ""), hits=hits,
                  scope_fields=_scope_fields(q), facts=facts, total=total, chats=_chat_rows(v, sc),
                  prev_href=_scope_href(user, agent, run, offset=max(0, offset - PAGE)) if offset else None,
                  next_href=_scope_href(user, agent, run, offset=offset + PAGE) if len(records) > PAGE else None)


def _offset(text: str) -> int:
    """The page's offset query parameter. Bounded before int(), which raises on thousands of
    digits (was a 500), and to what the store can page to."""
    if not (text.isascii() and text.isdigit() and len(text) <= len(str(MAX_OFFSET))) or int(text) > MAX_OFFSET:
        raise _Page(400, f"offset must be a whole number from 0 to {MAX_OFFSET}")
    return int(text)


def _label(user: str, agent: str | None, run: str | None) -> str:
    return " · ".join(x for x in (f"user {user}", agent and f"agent {agent}", run and f"run {run}") if x)


def _last_injected(traces) -> dict[str, float]:
    """fact id -> when a kept chat last injected it as KV (traces come newest first)."""
    out: dict[str, float] = {}
    for t in traces:
        for f in t.facts:
            if f.served == "kv":
                out.setdefault(f.id, t.created_at)
    return out


async def _hits(v: _View, query: str, sc: dict) -> list[dict] | None:
    """The scope's hybrid ranking for `query`, with each hit's dense and lexical scores beside it."""
    if not query:
        return None
    ranked = {}
    for ranking in ("hybrid", "dense", "lexical"):
        ranked[ranking] = await v.rt.call(lambda r=ranking: v.mem.search(query, **sc, k=10, ranking=r))
    dense = {h.id: h.score for h in ranked["dense"]}
    lexical = {h.id: h.score for h in ranked["lexical"]}
    return [{"id": h.id, "text": h.text, "score": h.score, "dense": _score(dense.get(h.id)),
             "lexical": _score(lexical.get(h.id))} for h in ranked["hybrid"]]


def _score(value: float | None) -> str:
    return "—" if value is None else f"{value:.4f}"


def _chat_rows(v: _View, sc: dict) -> list[dict]:
    rows = []
    for t in v.mem.recent_chats(sc["user_id"]):
        if (t.agent_id, t.run_id) != (sc["agent_id"], sc["run_id"]) and (sc["agent_id"] or sc["run_id"]):
            continue
        kv = sum(f.served == "kv" for f in t.facts)
        rows.append({"id": t.id, "when": when(t.created_at), "mode": t.mode, "question": t.question, "kv": kv,
                     "text": len(t.facts) - kv, "ttft_ms": t.ttft_ms})
    return rows


@router.get("/facts/{fact_id}")
async def fact(fact_id: str, request: Request) -> HTMLResponse:
    v = _View(request)
    r = v.fact(fact_id)
    blob = await v.rt.call(v.mem.blob, fact_id)
    rows = [("text", r.text), ("user", v.tenant.local(r.user_id)), ("agent", r.agent_id or ""), ("run", r.run_id or ""),
            ("origin", r.origin), ("context", r.context), ("metadata", json.dumps(r.metadata, ensure_ascii=False) if r.metadata else ""), ("source", r.source),
            ("event time", r.event_time or ""), ("created", when(r.created_at)), ("updated", when(r.updated_at)),
            ("expires", when(r.expires_at)), ("KV status", r.kv_status), ("KV tier", blob.tier or "none"),
            ("KV bytes", f"{blob.bytes:,}"), ("codec", blob.codec),
            ("uses", blob.uses)]
    history = [{"when": when(e.at), "event": e.event, "old": e.old_text, "new": e.new_text}
               for e in await v.rt.call(v.mem.history, fact_id)]
    return v.page("fact", f"Fact {fact_id}", f=r, rows=rows, history=history)


@router.get("/facts/{fact_id}/forget")
async def confirm_forget_fact(fact_id: str, request: Request) -> HTMLResponse:
    v = _View(request)
    r = v.fact(fact_id)
    return v.page("confirm", "Forget a fact", question="Forget this fact?", detail=r.text, fields=[],
                  action=f"/ui/facts/{fact_id}/forget", back=f"/ui/facts/{fact_id}")


@router.post("/facts/{fact_id}/forget")
async def forget_fact(fact_id: str, request: Request) -> Response:
    v = _View(request)
    await v.form()
    r = v.fact(fact_id)
    await v.rt.call(v.mem.delete, fact_id)
    return RedirectResponse(_scope_href(v.tenant.local(r.user_id), r.agent_id, r.run_id), status_code=303)


@router.get("/forget-scope")
async def confirm_forget_scope(request: Request) -> HTMLResponse:
    v = _View(request)
    q = request.query_params
    n = await v.rt.call(lambda: v.mem.count(**v.scope(dict(q))))
    return v.page("confirm", "Forget a scope", question=f"Forget every fact of {_label(q['user'], q.get('agent'), q.get('run'))}?",
                  detail=f"{n} facts (every agent's and run's within it, unless one is named): their text, vectors "
                         "and KV go; the history keeps the events only.",
                  fields=_scope_fields(q), action="/ui/forget-scope", back=_scope_href(q["user"], q.get("agent"), q.get("run")))


@router.post("/forget-scope")
async def forget_scope(request: Request) -> Response:
    v = _View(request)
    fields = await v.form()
    await v.rt.call(lambda: v.mem.delete_all(**v.scope(fields)))
    return RedirectResponse("/ui", status_code=303)


@router.get("/chats/{chat_id}")
async def chat(chat_id: str, request: Request) -> HTMLResponse:
    v = _View(request)
    t = v.mem.trace(chat_id)
    if t is None or not v.tenant.owns(t.user_id):
        raise _Page(404, "no trace of that chat: unknown, or older than its scope's ring")
    back = _scope_href(v.tenant.local(t.user_id), t.agent_id, t.run_id)
    return v.page("chat", "Chat x-ray", t=t, when=when(t.created_at), back=back)


@router.post("/ask")
async def ask(request: Request) -> HTMLResponse:
    """The playground: the question in KV mode, then in text mode, each with its x-ray."""
    v = _View(request)
    fields = await v.form()
    sc, question = v.scope(fields), fields.get("question", "").strip()
    if not question:
        raise _Page(400, "ask a question")
    if not v.rt.gate.enter():
        raise _Page(429, "the server is busy; try again shortly")
    try:
        sides = []
        for mode in ("kv", "text"):
            r = await v.rt.call(lambda m=mode: v.mem.chat(question, **sc, k=5, mode=m, max_tokens=48))
            sides.append({"mode": mode, "answer": r.answer, "ttft_ms": round(r.ttft_s * 1000, 1),
                          "trace": v.mem.trace(r.trace_id)})
    finally:
        v.rt.gate.leave()
    back = _scope_href(fields["user"], fields.get("agent"), fields.get("run"))
    return v.page("ask", "Ask", question=question, sides=sides, back=back)
