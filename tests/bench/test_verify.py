"""`kvmem verify` on the real engine: it passes on the bundled model, a planted rotation error
fails it, and chat mode "auto" serves what the cached verdict allows (text without one)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvmem.bench import oracle, verify
from kvmem.cli import main
from kvmem.config import default_home
from kvmem.model import verdict

DOG = "My dog is a brown labrador called Pepper."
Q = "What is my dog called?"
ROWS = {"support", "k=1 injection oracle", "k=10 true-prefix oracle", "fidelity, no reader: first-token agreement",
        "fidelity, no reader: top-20 KL"}


def test_kvmem_verify_passes_on_the_bundled_model_and_caches_its_verdict(tmp_path, capsys):
    """The command as a user runs it (its own engine, the shipped reader adapter): exit 0, the
    table, the verdict in --out and cached under the home; its facts never enter the home."""
    home, out = tmp_path / "home", tmp_path / "out"
    rc = main(["--home", str(home), "--models-home", str(default_home() / "models"), "verify", "--out", str(out)])
    printed = capsys.readouterr().out
    print(printed)
    assert rc == 0, printed
    assert "verdict: PASS" in printed
    saved = json.loads((out / "verify.json").read_text())
    assert saved["passed"] is True and ROWS <= {r["name"] for r in saved["rows"]}
    gates = {r["name"]: r["gate"] for r in saved["rows"]}
    # What KV mode serves is gated: with an adapter, its row; the plain row is reported only.
    assert gates["fidelity, reader adapter: first-token agreement"] is True
    assert gates["fidelity, no reader: first-token agreement"] is False
    assert verdict.load(home, saved["fingerprint"])["rows"] == saved["rows"]
    assert verdict.passed(home, saved["fingerprint"])
    assert not (home / "facts.sqlite").exists() and not (home / "kv").exists()


@pytest.fixture
def no_verdict(mem):
    """The session model starts unverified and is left so (other tests chat with it)."""
    path = verdict.verdict_path(mem.config.home, mem.model.fingerprint)
    path.unlink(missing_ok=True)
    yield path
    path.unlink(missing_ok=True)


def test_verify_passes_on_the_session_engine_then_auto_serves_kv(mem, no_verdict):
    user = "auto-verified"
    mem.add(facts=[DOG], user_id=user)
    before = mem.chat(Q, user_id=user, mode="auto", max_tokens=4)
    assert before.mode == "text" and before.injected_tokens == 0  # never verified: text, the safe side

    result = verify.run(mem)
    print("\n" + verify.report(result, mem.config.home))
    rows = {r["name"]: r for r in result["rows"]}
    assert result["passed"] and result["verdict"] == "pass", result
    assert ROWS <= rows.keys() and rows["fidelity, reader adapter"]["value"] == "none"  # the session engine has none
    assert rows["fidelity, no reader: first-token agreement"]["gate"]  # then plain KV is what is served
    assert rows["k=1 injection oracle"]["passed"] and rows["k=10 true-prefix oracle"]["passed"]
    # The fidelity points are reported beside what is served; "exact" is text prefill's arithmetic
    # on the CPU backend: within the engine's own noise of it.
    for point in ("balanced", "exact"):
        assert not rows[f"fidelity point {point}: first-token agreement"]["gate"]
    assert rows["fidelity point exact: gap to text prefill"]["passed"], rows["fidelity point exact: gap to text prefill"]
    # Bit-exact engine: exact is text prefill's first token on every question. A noisy one (an AMX
    # Xeon: cache hit 0.2 off) may flip a near-tie, but exact never agrees less often than plain KV.
    exact_gap = rows["fidelity point exact: gap to text prefill"]
    exact_noise = exact_gap["noise"]
    assert exact_noise is not None and rows["k=1 injection oracle"]["noise"] is not None
    exact_agreement = rows["fidelity point exact: first-token agreement"]["value"]
    if exact_noise == 0:
        assert exact_agreement == 1.0
    assert exact_agreement >= rows["fidelity, no reader: first-token agreement"]["value"]
    assert not mem.get_all(user_id=f"{verify.USER}-k1")  # its facts are gone again

    after = mem.chat(Q, user_id=user, mode="auto", max_tokens=4)
    assert after.mode == "kv" and after.injected_tokens > 0 and after.fallbacks == 0
    assert mem.recent_chats(user)[0].mode == "kv"  # the x-ray names the mode served too
    mem.delete_all(user_id=user)


def test_a_planted_rotation_error_fails_the_oracle_and_auto_serves_text(mem, no_verdict):
    """A wrong rotary, planted in the real engine's data: each blob says its keys were rotated
    for 512 positions further on than they were, so the connector turns them back by 512 positions
    as it injects them, as a connector with the wrong rotary turns every key it moves. The k=1
    oracle, which must equal text prefill, fails; auto then serves text."""
    user = "planted-rotation"
    ids = list(mem.add(facts=oracle.FACTS, user_id=user).ids)
    for fact_id in ids:
        blob = mem.kv.get(fact_id)
        mem.kv.put(replace(blob, key_position=blob.key_position + 512))
    row = verify.exact_row("k=1 injection oracle", oracle.k1_rows(mem, user, ids, oracle.QUESTIONS))
    print(f"\nplanted rotation: k=1 gap {row.value} against {row.tolerance} ({row.note})")
    assert not row.passed and "0 facts served as text" in row.note  # injected, and wrong
    result = verify.result(mem.model, [verify.Row("support", "started", "engine starts", True), row])
    assert not result["passed"] and result["verdict"] == "fail: k=1 injection oracle"
    assert "FAIL" in verify.report(result, mem.config.home)
    assert verdict.load(mem.config.home, mem.model.fingerprint)["passed"] is False

    r = mem.chat(Q, user_id=user, fact_ids=ids[:1], mode="auto", max_tokens=4)
    assert r.mode == "text" and r.injected_tokens == 0 and r.answer
    mem.delete_all(user_id=user)


def test_a_refusal_is_a_failed_verdict_with_its_reasons():
    from kvmem.model import resolve_model

    model = resolve_model(None, default_home() / "models")
    result = verify.refused(model, "kvmem cannot serve this vLLM configuration: MLA attention")
    assert not result["passed"] and result["verdict"].startswith("refused: kvmem cannot serve")
    assert result["rows"][0]["value"] == "refused"


def test_an_unreadable_or_foreign_verdict_counts_as_not_verified(tmp_path):
    fp = "ab" * 32
    assert verdict.load(tmp_path, fp) is None and not verdict.passed(tmp_path, fp)
    verdict.verdict_path(tmp_path, fp).parent.mkdir(parents=True)
    verdict.verdict_path(tmp_path, fp).write_text('{"passed": tr')  # cut short
    assert not verdict.passed(tmp_path, fp)
    verdict.verdict_path(tmp_path, fp).write_text(json.dumps({"passed": True, "fingerprint": "cd" * 32}))
    assert not verdict.passed(tmp_path, fp)  # a file copied from another model
    verdict.save(tmp_path, fp, {"passed": True})
    assert verdict.passed(tmp_path, fp)
