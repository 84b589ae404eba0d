"""The inspector's pages: Jinja templates with autoescape on, so every stored value (a fact that
holds `<script>` included) is shown as text. No script at all, no file from another origin: the
CSS is served by the page itself and the Content-Security-Policy says so."""

from __future__ import annotations

from datetime import datetime, timezone

from jinja2 import DictLoader, Environment, select_autoescape

CSP = ("default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; base-uri 'none'; "
       "frame-ancestors 'none'")

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0 2em 2em; color: #1d1d1f; }
header { display: flex; gap: 1.5em; align-items: baseline; border-bottom: 1px solid #ddd; padding: .8em 0; }
header h1 { font-size: 1.1em; margin: 0; } header form { margin-left: auto; }
table { border-collapse: collapse; width: 100%; margin: .6em 0 1.4em; }
th, td { text-align: left; padding: .3em .6em; border-bottom: 1px solid #eee; vertical-align: top; }
th { background: #f6f6f8; font-weight: 600; }
.kv { color: #0a7d33; font-weight: 600; } .text { color: #b35c00; font-weight: 600; }
.muted { color: #777; } .num { text-align: right; font-variant-numeric: tabular-nums; }
.pair { display: grid; grid-template-columns: 1fr 1fr; gap: 1.5em; }
.box { border: 1px solid #ddd; border-radius: 6px; padding: .8em 1em; }
input[type=text], input[type=password] { width: 28em; padding: .3em; }
button { padding: .3em .9em; } button.danger { color: #fff; background: #c0262d; border: 0; border-radius: 4px; }
.error { color: #c0262d; }
"""

_BASE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{ title }} · kvmem</title>
<link rel="stylesheet" href="/ui/style.css"></head><body>
<header><h1><a href="/ui">kvmem inspector</a></h1>
{% if tenant is defined and tenant %}<span class="muted">tenant {{ tenant }}</span>{% endif %}
{% if csrf is defined and csrf %}<form method="post" action="/ui/logout"><input type="hidden" name="csrf" value="{{ csrf }}">
<button>Log out</button></form>{% endif %}</header>
<main>{% block main %}{% endblock %}</main></body></html>"""

_LOGIN = """{% extends "base" %}{% block main %}
<h2>Log in</h2>{% if message %}<p class="error">{{ message }}</p>{% endif %}
<form method="post" action="/ui/login"><label>API key <input type="password" name="key" autofocus></label>
<button>Open</button></form>{% endblock %}"""

_SCOPES = """{% extends "base" %}{% block main %}
<h2>Scopes</h2>
<table id="scopes"><tr><th>user</th><th>agent</th><th>run</th><th class="num">facts</th><th class="num">KV bytes</th></tr>
{% for s in scopes %}<tr><td><a href="{{ s.href }}">{{ s.user }}</a></td><td>{{ s.agent or "" }}</td>
<td>{{ s.run or "" }}</td><td class="num">{{ s.facts }}</td><td class="num">{{ "{:,}".format(s.kv_bytes) }}</td></tr>
{% else %}<tr><td colspan="5" class="muted">no facts yet</td></tr>{% endfor %}</table>{% endblock %}"""

_SCOPE = """{% extends "base" %}{% block main %}
<h2>{{ label }}</h2>
<form method="get" action="/ui/scope" id="search">{% for k, v in scope_fields %}<input type="hidden" name="{{ k }}" value="{{ v }}">{% endfor %}
<input type="text" name="q" value="{{ q }}" placeholder="search this scope's facts"> <button>Search</button></form>
{% if hits is not none %}<h3>Hits for “{{ q }}”</h3>
<table id="hits"><tr><th>#</th><th>fact</th><th class="num">hybrid</th><th class="num">dense</th><th class="num">lexical</th></tr>
{% for h in hits %}<tr><td>{{ loop.index }}</td><td><a href="/ui/facts/{{ h.id }}">{{ h.text }}</a></td>
<td class="num">{{ "%.4f"|format(h.score) }}</td><td class="num">{{ h.dense }}</td><td class="num">{{ h.lexical }}</td></tr>
{% else %}<tr><td colspan="5" class="muted">no hits</td></tr>{% endfor %}</table>{% endif %}
<h3>Ask (KV mode and text mode side by side)</h3>
<form method="post" action="/ui/ask" id="ask"><input type="hidden" name="csrf" value="{{ csrf }}">
{% for k, v in scope_fields %}<input type="hidden" name="{{ k }}" value="{{ v }}">{% endfor %}
<input type="text" name="question" placeholder="a question for this scope"> <button>Ask both</button></form>
<h3>Facts ({{ total }})</h3>
<table id="facts"><tr><th>fact</th><th>origin</th><th>metadata</th><th>created</th><th>KV</th><th>tier</th>
<th class="num">bytes</th><th>codec</th><th class="num">uses</th><th>last injected</th></tr>
{% for f in facts %}<tr><td><a href="/ui/facts/{{ f.id }}">{{ f.text }}</a></td><td>{{ f.origin }}</td>
<td><code>{{ f.metadata }}</code></td><td>{{ f.created }}</td><td>{{ f.kv_status }}</td><td>{{ f.tier or "—" }}</td>
<td class="num">{{ "{:,}".format(f.bytes) }}</td><td>{{ f.codec }}</td><td class="num">{{ f.uses }}</td>
<td>{{ f.last_injected or "—" }}</td></tr>{% endfor %}</table>
<p>{% if prev_href %}<a href="{{ prev_href }}">← newer</a>{% endif %} {% if next_href %}<a href="{{ next_href }}">older →</a>{% endif %}</p>
<h3>Recent chats</h3>
<table id="chats"><tr><th>when</th><th>mode</th><th>question</th><th class="num">facts as KV</th>
<th class="num">as text</th><th class="num">TTFT ms</th></tr>
{% for c in chats %}<tr><td><a href="/ui/chats/{{ c.id }}">{{ c.when }}</a></td><td>{{ c.mode }}</td><td>{{ c.question }}</td>
<td class="num">{{ c.kv }}</td><td class="num">{{ c.text }}</td><td class="num">{{ c.ttft_ms }}</td></tr>
{% else %}<tr><td colspan="6" class="muted">no chats kept for this scope</td></tr>{% endfor %}</table>
<form method="get" action="/ui/forget-scope">{% for k, v in scope_fields %}<input type="hidden" name="{{ k }}" value="{{ v }}">{% endfor %}
<button class="danger">Forget this scope…</button></form>{% endblock %}"""

_FACT = """{% extends "base" %}{% block main %}
<h2>Fact <code>{{ f.id }}</code></h2>
<table id="fact">{% for k, v in rows %}<tr><th>{{ k }}</th><td>{{ v }}</td></tr>{% endfor %}</table>
<h3>History</h3>
<table id="history"><tr><th>when</th><th>event</th><th>old</th><th>new</th></tr>
{% for e in history %}<tr><td>{{ e.when }}</td><td>{{ e.event }}</td><td>{{ e.old or "" }}</td><td>{{ e.new or "" }}</td></tr>
{% endfor %}</table>
<form method="get" action="/ui/facts/{{ f.id }}/forget"><button class="danger">Forget this fact…</button></form>
{% endblock %}"""

_CONFIRM = """{% extends "base" %}{% block main %}
<h2>{{ question }}</h2><p>{{ detail }}</p>
<form method="post" action="{{ action }}" id="confirm"><input type="hidden" name="csrf" value="{{ csrf }}">
{% for k, v in fields %}<input type="hidden" name="{{ k }}" value="{{ v }}">{% endfor %}
<button class="danger">Forget</button> <a href="{{ back }}">Cancel</a></form>{% endblock %}"""

_TRACE_TABLE = """<table class="trace"><tr><th>#</th><th>fact</th><th class="num">score</th><th>served</th>
<th>why text</th><th class="num">tokens</th></tr>
{% for f in t.facts %}<tr><td>{{ loop.index }}</td><td><a href="/ui/facts/{{ f.id }}">{{ f.text }}</a></td>
<td class="num">{{ "%.4f"|format(f.score) if f.score is not none else "—" }}</td>
<td class="{{ f.served }}">{{ f.served }}</td><td>{{ f.reason or "" }}</td><td class="num">{{ f.tokens }}</td></tr>
{% endfor %}</table>
<p>{{ t.prompt_tokens }} prompt tokens, {{ t.injected_tokens }} injected (prefill saved), TTFT {{ t.ttft_ms }} ms,
retrieval {{ t.retrieval_ms }} ms</p>"""

_CHAT = """{% extends "base" %}{% block main %}
<h2>Chat x-ray</h2><p>{{ when }} · mode <b>{{ t.mode }}</b> · “{{ t.question }}”</p>
{% include "trace" %}<p><a href="{{ back }}">← the scope</a></p>{% endblock %}"""

_ASK = """{% extends "base" %}{% block main %}
<h2>“{{ question }}”</h2><div class="pair">
{% for side in sides %}<div class="box" id="answer-{{ side.mode }}"><h3>{{ side.mode }} mode</h3>
<p class="answer">{{ side.answer }}</p><p>TTFT {{ side.ttft_ms }} ms · <a href="/ui/chats/{{ side.trace.id }}">x-ray</a></p>
{% with t = side.trace %}{% include "trace" %}{% endwith %}</div>{% endfor %}</div>
<p><a href="{{ back }}">← the scope</a></p>{% endblock %}"""

_ERROR = """{% extends "base" %}{% block main %}<h2>{{ status }}</h2><p class="error">{{ message }}</p>
<p><a href="/ui">Back</a></p>{% endblock %}"""

ENV = Environment(loader=DictLoader({"base": _BASE, "login": _LOGIN, "scopes": _SCOPES, "scope": _SCOPE,
                                     "fact": _FACT, "confirm": _CONFIRM, "trace": _TRACE_TABLE, "chat": _CHAT,
                                     "ask": _ASK, "error": _ERROR}),
                  autoescape=select_autoescape(default=True, default_for_string=True))


def render(name: str, **values) -> str:
    return ENV.get_template(name).render(**values)


def when(ts: float | None) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC") if ts else ""
