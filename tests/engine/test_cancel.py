"""Cancelling: a chat whose caller gives up is aborted in vLLM, not generated to max_tokens."""

from __future__ import annotations

import threading
import time

import pytest

from kvmem.errors import RequestCancelled

LONG = "Write the numbers from 1 to 5000, one per line, with no other text."


def unfinished(mem) -> int:
    return mem.engine._engine.get_num_unfinished_requests()


def wait_for(check, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_setting_cancel_aborts_a_running_chat(mem):
    cancel, outcome = threading.Event(), {}

    def chat():
        try:
            outcome["result"] = mem.chat(LONG, user_id="cancel", mode="off", max_tokens=3000, cancel=cancel)
        except RequestCancelled as e:
            outcome["error"] = e

    aborted = mem.engine.aborted
    worker = threading.Thread(target=chat)
    worker.start()
    wait_for(lambda: unfinished(mem) == 1, "the chat to reach the engine")
    cancel.set()
    worker.join(60)
    assert not worker.is_alive() and "error" in outcome, outcome
    wait_for(lambda: unfinished(mem) == 0, "vLLM to drop the request")
    assert mem.engine.aborted == aborted + 1  # counted before vLLM drops it (this raced once)


def test_closing_a_stream_early_aborts_it(mem):
    aborted = mem.engine.aborted
    stream = mem.chat_stream(LONG, user_id="cancel", mode="off", max_tokens=3000)
    assert isinstance(next(stream), str)
    stream.close()
    wait_for(lambda: mem.engine.aborted == aborted + 1, "the abort")
    wait_for(lambda: unfinished(mem) == 0, "vLLM to drop the request")


def test_a_cancel_set_before_the_answer_raises_and_the_engine_keeps_serving(mem):
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(RequestCancelled):
        mem.chat("Hi", user_id="cancel", mode="off", max_tokens=3000, cancel=cancel)
    assert mem.chat("Hi", user_id="cancel", mode="off", max_tokens=2).answer is not None


def test_a_failed_step_fails_its_callers_and_aborts_their_requests(mem, monkeypatch):
    """Callers hear EngineError, and vLLM no longer holds (or generates) their requests."""
    from kvmem.errors import EngineError

    real_step, calls = mem.engine._engine.step, []

    def failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(mem.engine._engine, "step", failing_once)
    with pytest.raises(EngineError, match="injected step failure"):
        mem.chat(LONG, user_id="cancel", mode="off", max_tokens=3000)
    assert unfinished(mem) == 0  # aborted before the caller was told
    assert mem.chat("Hi", user_id="cancel", mode="off", max_tokens=2).answer is not None
