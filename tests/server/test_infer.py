"""add with infer over HTTP, and the extraction LLM as an OpenAI-compatible endpoint: the real
`kvmem serve` of this directory (its /v1/chat/completions honours response_format json_schema)."""

from __future__ import annotations

import json
import uuid

import jsonschema
import pytest
from fastapi.testclient import TestClient

from kvmem.config import Config, ExtractConfig, default_home
from kvmem.extract import prompts
from kvmem.extract.llm import OpenAILLM
from kvmem.server.app import create_app
from kvmem.server.settings import ServerSettings
from kvmem.service import KVMem
from tests.server.conftest import assert_error
from tests.server.serverproc import KEYS

TURNS = [{"role": "user", "content": "I keep bees on the roof of my flat in Ghent.", "timestamp": "2024-06-01"},
         {"role": "assistant", "content": "How many hives do you have?"},
         {"role": "user", "content": "Three hives. I started last week."}]


def _user() -> str:
    return f"infer-{uuid.uuid4().hex[:8]}"


def test_the_endpoint_path_against_a_real_openai_compatible_server(server):
    llm = OpenAILLM(server.url + "/v1", api_key=KEYS["alpha"])  # no model: the first of GET /models
    schema = prompts.facts_schema()
    reply = llm.complete(prompts.extraction_messages(TURNS), schema, name="facts",
                         max_tokens=prompts.max_tokens_for(schema), user_id="ignored")
    jsonschema.validate(json.loads(reply), schema)
    assert llm.model in {m["id"] for m in server.client().get("/v1/models").json()["data"]}


def _local(tmp_path, model_dir, url: str) -> KVMem:
    """A service with no engine of its own: extraction goes to `url`, nothing is encoded."""
    config = Config(home=tmp_path / "home", models_home=model_dir.parent,
                    extract=ExtractConfig(url=url, api_key=KEYS["alpha"]))
    return KVMem(config, start_engine=False)


def test_add_with_infer_through_an_endpoint_stores_what_it_extracted(server, tmp_path, model_dir):
    with _local(tmp_path, model_dir, server.url + "/v1") as mem:
        result = mem.add(TURNS, user_id="u", infer=True, encode="none")
        assert result.results and {c.event for c in result.results} <= {"ADD", "NONE"}
        assert {f.id for f in mem.get_all(user_id="u")} == set(result.ids)


def test_an_endpoint_that_is_down_is_503_with_nothing_stored(tmp_path, model_dir):
    mem = _local(tmp_path, model_dir, "http://127.0.0.1:9/v1")  # port 9 (discard): nothing listens
    app = create_app(ServerSettings(api_keys={"k1": "t1"}), mem_factory=lambda: mem)
    with TestClient(app, headers={"Authorization": "Bearer k1"}) as c:
        assert app.state.runtime.loaded.wait(30), app.state.runtime.error
        r = c.post("/v1/memories", json={"user_id": "u", "messages": TURNS, "infer": True})
        error = assert_error(r, 503, "infer")
        assert error["code"] == "extractor_unavailable" and error["type"] == "server_error"
        r = c.post("/v3/memories/add/", json={"user_id": "u", "messages": TURNS, "infer": True})
        assert_error(r, 503, "infer")
        assert c.get("/v1/memories", params={"user_id": "u"}).json()["total"] == 0


def test_v1_memories_with_infer_answers_mem0s_shape(alpha):
    user = _user()
    r = alpha.post("/v1/memories", json={"user_id": user, "messages": TURNS, "infer": True, "encode": "sync",
                                         "metadata": {"topic": "bees"}})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert results and set(r.json()) == {"results"}
    for item in results:
        assert item["event"] in ("ADD", "NONE") and item["memory"] and item["user_id"] == user
        assert item["metadata"]["source"] == "infer" and item["metadata"]["topic"] == "bees"
        assert item["kv_status"] == "encoded" and item["origin"]
    listed = alpha.get("/v1/memories", params={"user_id": user}).json()
    assert {m["id"] for m in listed["results"]} == {m["id"] for m in results}


@pytest.mark.parametrize("body, param", [({"infer": "maybe"}, "infer"), ({"infer": True, "facts": ["x"]}, "facts")])
def test_bad_infer_requests_are_400(alpha, body, param):
    r = alpha.post("/v1/memories", json={"user_id": _user(), **({"messages": TURNS} if "facts" not in body else {}),
                                         **body})
    assert_error(r, 400, param)


def test_cli_add_infer_through_the_endpoint(server, tmp_path, capsys, monkeypatch):
    from kvmem.cli import main

    monkeypatch.setenv("KVMEM_EXTRACT_URL", server.url + "/v1")
    monkeypatch.setenv("KVMEM_EXTRACT_API_KEY", KEYS["alpha"])
    base = ["--home", str(tmp_path / "home"), "--models-home", str(default_home() / "models")]
    capsys.readouterr()
    assert main([*base, "add", "--user", "u", "--no-encode", "--infer", TURNS[0]["content"], TURNS[2]["content"]]) == 0
    *facts, summary = capsys.readouterr().out.splitlines()
    assert facts and summary == f"{len(facts)} add, 0 update, 0 delete, 0 none"  # a fresh home: all new
    assert all(line.startswith("f-") and line.split()[1] == "ADD" for line in facts)


def test_eval_extract_measures_a_model_behind_an_endpoint(server, tmp_path, locomo_path, capsys, monkeypatch):
    """A user measures their own model: `eval extract --extract-url` with no engine of its own."""
    from kvmem.cli import main

    home, out = tmp_path / "home", tmp_path / "out"
    argv = ["--home", str(home), "--models-home", str(default_home() / "models"), "eval", "extract",
            "--extract-url", server.url + "/v1", "--conversations", "conv-30", "--sessions", "1",
            "--turns-per-add", "10", "--data", str(locomo_path), "--out", str(out)]
    monkeypatch.setenv("KVMEM_EXTRACT_API_KEY", KEYS["alpha"])
    assert main(argv) == 0
    result = json.loads((out / "extract-conv-30-t10-s1.json").read_text())
    assert result["llm"].startswith(server.url + "/v1") and KEYS["alpha"] not in json.dumps(result)
    growth = result["conversations"]["conv-30"]["growth"]
    assert [g["turns"] for g in growth] == [20] and growth[0]["reconciled"] <= growth[0]["all_added"]
    assert "facts: recall" in capsys.readouterr().out
    logs = list((home / "eval").glob("locomo-conv-30-extracted-t10-*.jsonl"))  # named by the endpoint
    assert len(logs) == 1 and len(eval_log_rows(logs[0])) == 2


def eval_log_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_down_endpoint_can_store_the_messages_as_turns_instead(tmp_path, model_dir):
    """[extract] on_unavailable = "turns": the add still stores what was said, as infer=False
    would, and says so; a second call reports the turns already held as NONE."""
    config = Config(home=tmp_path / "home", models_home=model_dir.parent,
                    extract=ExtractConfig(url="http://127.0.0.1:9/v1", on_unavailable="turns"))
    mem = KVMem(config, start_engine=False)
    app = create_app(ServerSettings(api_keys={"k1": "t1"}), mem_factory=lambda: mem)
    with TestClient(app, headers={"Authorization": "Bearer k1"}) as c:
        assert app.state.runtime.loaded.wait(30), app.state.runtime.error
        body = {"user_id": "u", "messages": TURNS, "infer": True}  # no engine here: nothing encodes
        first = c.post("/v1/memories", json=body).json()
        assert first["stored_as_turns"] is True and [m["event"] for m in first["results"]] == ["ADD"] * 3
        listed = c.get("/v1/memories", params={"user_id": "u"}).json()["results"]
        assert [m["memory"] for m in first["results"]] == [m["memory"] for m in listed]
        assert [m["memory"] for m in listed][0].endswith(TURNS[0]["content"])
        again = c.post("/v3/memories/add/", json=body).json()
        assert again["stored_as_turns"] is True and [m["event"] for m in again["results"]] == ["NONE"] * 3


def test_on_unavailable_takes_only_its_two_values():
    with pytest.raises(ValueError, match="on_unavailable"):
        ExtractConfig(on_unavailable="retry")
