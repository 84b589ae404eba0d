"""Chat mode "auto" over HTTP, on the session's real engine: the response's memory.mode is the
mode served, text until the model's `kvmem verify` verdict passed, KV after."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from kvmem.model import verdict
from kvmem.server.app import create_app
from kvmem.server.settings import ServerSettings

CHAT = {"model": "kvmem", "user": "auto-http", "max_tokens": 4, "memory": {"mode": "auto"},
        "messages": [{"role": "user", "content": "What is my dog called?"}]}


class Lent:
    """The session's KVMem, lent to an app whose shutdown must not close it."""

    def __init__(self, mem) -> None:
        self._mem = mem

    def __getattr__(self, name):
        return getattr(self._mem, name)

    def close(self) -> None:
        pass


def test_auto_mode_reports_the_mode_it_served(mem):
    path = verdict.verdict_path(mem.config.home, mem.model.fingerprint)
    path.unlink(missing_ok=True)
    app = create_app(ServerSettings(api_keys={"k1": "t1"}), mem_factory=lambda: Lent(mem))
    try:
        with TestClient(app, headers={"Authorization": "Bearer k1"}) as c:
            assert app.state.runtime.loaded.wait(30) and app.state.runtime.mem is not None
            added = c.post("/v1/memories", json={"user_id": "auto-http", "facts": ["My dog is called Pepper."],
                                                 "encode": "sync"})
            assert added.status_code == 200, added.text
            unverified = c.post("/v1/chat/completions", json=CHAT).json()["memory"]
            assert unverified["mode"] == "text" and unverified["injected_tokens"] == 0
            verdict.save(mem.config.home, mem.model.fingerprint, {"passed": True})
            verified = c.post("/v1/chat/completions", json=CHAT).json()["memory"]
            assert verified["mode"] == "kv" and verified["injected_tokens"] > 0
            stream = c.post("/v1/chat/completions", json={**CHAT, "stream": True})
            chunks = [json.loads(line[6:]) for line in stream.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            assert [ch["memory"]["mode"] for ch in chunks if "memory" in ch] == ["kv"]
            bad = c.post("/v1/chat/completions", json={**CHAT, "memory": {"mode": "fast"}})
            assert bad.status_code == 400 and "auto" in bad.text
        mem.delete_all(user_id="t1::auto-http")
    finally:
        path.unlink(missing_ok=True)
