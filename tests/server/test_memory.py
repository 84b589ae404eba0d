"""The memory API round-trips: add, list, get, update, search, history, delete, delete scope."""

from __future__ import annotations

import time

CONVERSATION = [{"role": "user", "content": "I moved to Porto last month."},
                {"role": "assistant", "content": "Welcome! What brought you there?"},
                {"role": "user", "content": "A job at a tram signalling company."}]


def wait_encoded(client, user: str, timeout: float = 120.0) -> list[dict]:
    """The user's facts once all are encoded; fails (never returns) if they are not in time."""
    deadline = time.monotonic() + timeout
    while True:
        facts = client.get("/v1/memories", params={"user_id": user, "limit": 1000}).json()["results"]
        if all(f["kv_status"] == "encoded" for f in facts):
            return facts
        assert time.monotonic() < deadline, f"not encoded after {timeout} s: {[f['kv_status'] for f in facts]}"
        time.sleep(0.5)


def test_round_trip(alpha):
    user = "mem-user"
    r = alpha.post("/v1/memories", json={"user_id": user, "messages": CONVERSATION, "metadata": {"topic": "move"}})
    assert r.status_code == 200, r.text
    added = r.json()
    assert added["created"] == 3 and [m["event"] for m in added["results"]] == ["ADD"] * 3
    assert all(m["user_id"] == user and m["kv_status"] in ("pending", "encoded") for m in added["results"])
    again = alpha.post("/v1/memories", json={"user_id": user, "facts": ["user: I moved to Porto last month."]})
    assert again.json()["duplicates"] == 1 and again.json()["results"][0]["event"] == "NOOP"
    dated = alpha.post("/v1/memories", json={"user_id": f"{user}-dated", "facts": ["I moved to Porto."],
                                             "timestamp": "2023-05-09"}).json()["results"][0]
    assert dated["memory"] == "[9 May 2023] I moved to Porto." and dated["metadata"]["timestamp"] == "2023-05-09"
    said = "user: I start at the tram signalling company on Monday, the Trindade depot."
    drawn = alpha.post("/v1/memories", json={"user_id": f"{user}-drawn", "facts": ["The user has a new job."],
                                             "origin": said}).json()["results"][0]
    assert drawn["memory"] == "The user has a new job." and drawn["origin"] == said
    found = alpha.post("/v1/memories/search", json={"user_id": f"{user}-drawn", "query": "Trindade depot"}).json()
    assert [h["id"] for h in found["results"]] == [drawn["id"]]
    bad = alpha.post("/v1/memories", json={"user_id": user, "messages": CONVERSATION, "origin": said})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "origin", bad.text

    listed = alpha.get("/v1/memories", params={"user_id": user}).json()
    assert listed["total"] == 3 and [m["id"] for m in listed["results"]] == [m["id"] for m in added["results"]]
    page = alpha.get("/v1/memories", params={"user_id": user, "limit": 2, "offset": 2}).json()
    assert [m["id"] for m in page["results"]] == [added["results"][2]["id"]]
    assert all(f["kv_status"] == "encoded" for f in wait_encoded(alpha, user))

    fact_id = added["results"][0]["id"]
    got = alpha.get(f"/v1/memories/{fact_id}").json()
    assert got["memory"] == "user: I moved to Porto last month." and got["metadata"] == {"topic": "move"}
    updated = alpha.put(f"/v1/memories/{fact_id}", json={"text": "I moved to Lisbon last month."}).json()
    assert updated["memory"] == "I moved to Lisbon last month." and updated["id"] == fact_id

    hits = alpha.post("/v1/memories/search", json={"user_id": user, "query": "Which city did I move to?",
                                                   "limit": 1}).json()["results"]
    assert hits[0]["id"] == fact_id and isinstance(hits[0]["score"], float)
    events = alpha.get(f"/v1/memories/{fact_id}/history").json()["results"]
    assert [e["event"] for e in events] == ["ADD", "UPDATE"] and events[1]["new_memory"].endswith("Lisbon last month.")

    assert alpha.delete(f"/v1/memories/{fact_id}").json()["deleted"] is True
    assert alpha.get(f"/v1/memories/{fact_id}").status_code == 404
    assert alpha.delete("/v1/memories", params={"user_id": user}).json()["deleted"] == 2
    assert alpha.get("/v1/memories", params={"user_id": user}).json()["results"] == []


def test_scope_filters(alpha):
    for agent in ("a1", "a2"):
        alpha.post("/v1/memories", json={"user_id": "scoped", "agent_id": agent, "facts": [f"Fact for {agent}."]})
    only = alpha.get("/v1/memories", params={"user_id": "scoped", "agent_id": "a1"}).json()["results"]
    assert [m["memory"] for m in only] == ["Fact for a1."] and only[0]["agent_id"] == "a1"
    assert alpha.delete("/v1/memories", params={"user_id": "scoped", "agent_id": "a2"}).json()["deleted"] == 1
    assert alpha.get("/v1/memories", params={"user_id": "scoped"}).json()["total"] == 1
