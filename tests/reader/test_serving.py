"""Serving with a reader adapter: vLLM runs KV-mode chats with it, and nothing else."""

from __future__ import annotations

import pytest
import torch

from kvmem.config import Config, EngineConfig, default_home
from kvmem.connector.plan import ENCODE, KEY
from kvmem.reader import adapters, lora
from tests.helpers import TEST_KV_CACHE_GIB
from tests.reader.test_kvmap import random_map

FACTS = ["My sister adopted a puppy named Bruno.", "I live in Lisbon near the river.",
         "I play the cello every Sunday morning."]


@pytest.fixture(scope="module")
def reader_mem(model_dir, tmp_path_factory):
    from kvmem.model import resolve_model
    from kvmem.tune.train import load_model
    from kvmem.service import KVMem

    home = tmp_path_factory.mktemp("reader-home")
    info = resolve_model(None, default_home() / "models")
    model = load_model(model_dir)
    wrapped = lora.attach(model, rank=8, alpha=16.0)
    torch.manual_seed(0)
    with torch.no_grad():
        for _, m in wrapped:
            m.lora_B.normal_(0, 0.3)  # an adapter that visibly changes the reader (shifts of ~1 nat)
    c = model.config
    kv_map = random_map(c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads, spread=0.1)
    lora.save(wrapped, adapters.user_folder(home, info.fingerprint), rank=8, alpha=16.0, base_model=str(model_dir),
              meta={"fingerprint": info.fingerprint}, kv_map=kv_map)  # a LoRA and a KV map, both visible
    engine = EngineConfig(cpu_kv_space_gib=TEST_KV_CACHE_GIB)
    mem = KVMem(Config(home=home, models_home=default_home() / "models", engine=engine), background=False)
    yield mem
    mem.close()


def test_only_kv_mode_chats_read_with_the_adapter(reader_mem, monkeypatch):
    mem = reader_mem
    assert mem.engine.reader_adapter == adapters.user_folder(mem.config.home, mem.model.fingerprint)
    sent = []
    submit = mem.engine.submit

    def recording(request, *args, **kwargs):  # the real engine, with a record of what it was sent
        sent.append(request)
        return submit(request, *args, **kwargs)

    monkeypatch.setattr(mem.engine, "submit", recording)
    ids = list(mem.add(facts=FACTS, user_id="reader").ids)
    encodes = [r for r in sent if r.plan is not None and r.plan.op == ENCODE]
    assert encodes and not any(r.reader for r in encodes)
    q = "What is my sister's puppy called?"
    kv = mem.chat(q, user_id="reader", fact_ids=ids, mode="kv", max_tokens=4)
    plain = mem.chat(q, user_id="reader", fact_ids=ids, mode="kv", max_tokens=4, reader=False)
    text = mem.chat(q, user_id="reader", fact_ids=ids, mode="text", max_tokens=4)
    assert [r.reader for r in sent[-3:]] == [True, False, False]
    # What vLLM itself reports: its output for the request names the LoRA it ran with.
    assert (kv.reader_adapter, plain.reader_adapter, text.reader_adapter) == (True, False, False)
    assert kv.injected_tokens > 0 and plain.injected_tokens == kv.injected_tokens
    shared = set(kv.first_logprobs) & set(plain.first_logprobs)
    assert shared and max(abs(kv.first_logprobs[t] - plain.first_logprobs[t]) for t in shared) > 1e-3
    scored = mem.score(q, "Bruno", user_id="reader", fact_ids=ids, mode="kv")
    scored_plain = mem.score(q, "Bruno", user_id="reader", fact_ids=ids, mode="kv", reader=False)
    assert sent[-2].reader and not sent[-1].reader
    assert scored != scored_plain


def test_scoring_several_kv_chats_at_once_with_the_adapter(reader_mem):
    """Prompt logprobs of several adapter requests in one engine step (LoRA once broke on them)."""
    from concurrent.futures import ThreadPoolExecutor

    mem = reader_mem
    ids = list(mem.add(facts=FACTS, user_id="reader-batch").ids)
    questions = ["What is my sister's puppy called?", "Where do I live?", "What do I play on Sundays?",
                 "What food do I like?"]
    with ThreadPoolExecutor(4) as pool:
        scored = list(pool.map(lambda q: mem.score(q, "Bruno the puppy", user_id="reader-batch", fact_ids=ids,
                                                   mode="kv"), questions))
    alone = mem.score(questions[0], "Bruno the puppy", user_id="reader-batch", fact_ids=ids, mode="kv")
    assert all(len(s) == len(alone) for s in scored)
    assert max(abs(a - b) for a, b in zip(scored[0], alone)) < 0.1  # batching must not change the reader


def test_the_engine_reads_with_the_adapter_as_the_lab_does(reader_mem, model_dir):
    """Oracle: the first-token shift the adapter causes in vLLM (bf16, LoRA request, KV map
    applied by the connector) against the same shift in the PyTorch lab (fp32, reader/lab.py) on
    the same chat. A LoRA scaled or placed differently by vLLM (alpha, rank, other projections),
    or a KV map applied to other tokens, heads or dimensions, would change the slope."""
    from kvmem.reader import kvmap
    from kvmem.tune.examples import from_records
    from kvmem.tune.lab import memory_cache, reply_logits
    from kvmem.tune.train import load_model

    mem = reader_mem
    ids = list(mem.add(facts=FACTS, user_id="reader-lab").ids)
    q = "Tell me about my family."
    kv = mem.chat(q, user_id="reader-lab", fact_ids=ids, mode="kv", max_tokens=1, logprobs=20)
    plain = mem.chat(q, user_id="reader-lab", fact_ids=ids, mode="kv", max_tokens=1, logprobs=20, reader=False)
    model = load_model(model_dir)
    wrapped = lora.attach(model, rank=8, alpha=16.0)
    lora.load_into(wrapped, mem.engine.reader_adapter)
    ex = from_records(mem.prompts, [mem.get(i) for i in ids], [{"role": "user", "content": q}])
    with torch.no_grad():
        with lora.disabled(wrapped):
            layers = memory_cache(model, ex)
            lab_plain = reply_logits(model, ex, (0,), layers)[0].log_softmax(-1)
        mapped = kvmap.apply(layers, len(ex.head), len(ex.memory_ids), kvmap.load(mem.engine.reader_adapter))
        lab_kv = reply_logits(model, ex, (0,), mapped)[0].log_softmax(-1)
        lab_lora_only = reply_logits(model, ex, (0,), layers)[0].log_softmax(-1)
    shared = sorted(set(kv.first_logprobs) & set(plain.first_logprobs))
    engine = torch.tensor([kv.first_logprobs[t] - plain.first_logprobs[t] for t in shared])
    lab = (lab_kv - lab_plain)[shared].double()
    slope = float(engine.double() @ lab / (lab @ lab))
    assert len(shared) >= 10 and lab.abs().max() > 0.5  # the adapter moves the reader well past bf16 noise
    assert torch.corrcoef(torch.stack([engine.double(), lab]))[0, 1] > 0.95 and 0.85 < slope < 1.15  # 0.99, 1.00
    # The map is part of what the engine did: the lab's LoRA alone explains it worse.
    lora_only = (lab_lora_only - lab_plain)[shared].double()
    assert (engine.double() - lab).norm() < 0.5 * (engine.double() - lora_only).norm()


@pytest.fixture(scope="module")
def map_only_mem(model_dir, tmp_path_factory):
    """An adapter with a KV map and no LoRA: vLLM runs no LoRA, the connector maps the facts."""
    from kvmem.model import resolve_model
    from kvmem.tune.train import load_model
    from kvmem.service import KVMem

    home = tmp_path_factory.mktemp("map-home")
    info = resolve_model(None, default_home() / "models")
    c = load_model(model_dir).config
    kv_map = random_map(c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads,
                        seed=1, spread=0.1)
    lora.save([], adapters.user_folder(home, info.fingerprint), rank=8, alpha=16.0, base_model=str(model_dir),
              meta={"fingerprint": info.fingerprint}, kv_map=kv_map)
    engine = EngineConfig(cpu_kv_space_gib=TEST_KV_CACHE_GIB)
    mem = KVMem(Config(home=home, models_home=default_home() / "models", engine=engine), background=False)
    yield mem
    mem.close()


def test_a_map_only_adapter_maps_kv_chats_alone_as_the_lab_does(map_only_mem, model_dir):
    from kvmem.reader import kvmap
    from kvmem.tune.examples import from_records
    from kvmem.tune.lab import memory_cache, reply_logits
    from kvmem.tune.train import load_model

    mem = map_only_mem
    assert mem.engine.reader_adapter is not None and not lora.has_lora(mem.engine.reader_adapter)
    ids = list(mem.add(facts=FACTS, user_id="map").ids)
    q = "Tell me about my family."
    kv = mem.chat(q, user_id="map", fact_ids=ids, mode="kv", max_tokens=1, logprobs=20)
    plain = mem.chat(q, user_id="map", fact_ids=ids, mode="kv", max_tokens=1, logprobs=20, reader=False)
    text = mem.chat(q, user_id="map", fact_ids=ids, mode="text", max_tokens=1, logprobs=20)
    # What the connector reports: it mapped the KV chat's facts, and nothing else.
    assert (kv.reader_adapter, plain.reader_adapter, text.reader_adapter) == (True, False, False)
    again = mem.chat(q, user_id="map", fact_ids=ids, mode="kv", max_tokens=1, logprobs=20)
    assert again.first_logprobs == kv.first_logprobs  # served from the prefix cache under its own salt
    model = load_model(model_dir)
    ex = from_records(mem.prompts, [mem.get(i) for i in ids], [{"role": "user", "content": q}])
    with torch.no_grad():
        layers = memory_cache(model, ex)
        lab_plain = reply_logits(model, ex, (0,), layers)[0].log_softmax(-1)
        mapped = kvmap.apply(layers, len(ex.head), len(ex.memory_ids), kvmap.load(mem.engine.reader_adapter))
        lab_kv = reply_logits(model, ex, (0,), mapped)[0].log_softmax(-1)
    shared = sorted(set(kv.first_logprobs) & set(plain.first_logprobs))
    engine = torch.tensor([kv.first_logprobs[t] - plain.first_logprobs[t] for t in shared]).double()
    lab = (lab_kv - lab_plain)[shared].double()
    slope = float(engine @ lab / (lab @ lab))
    assert len(shared) >= 10 and lab.abs().max() > 0.5, lab.abs().max()
    assert torch.corrcoef(torch.stack([engine, lab]))[0, 1] > 0.95 and 0.85 < slope < 1.15, slope


def test_the_kv_map_reads_facts_encoded_after_a_context_too(map_only_mem, monkeypatch):
    """The shipped map is distilled on observations and on turns encoded after their context
    window (it reads both better than no map: docs/benchmarks.md), so a KV-mode chat over turns
    asks for it as a chat over plain facts does: map_from at the head's end."""
    mem = map_only_mem
    sent = []
    submit = mem.engine.submit
    monkeypatch.setattr(mem.engine, "submit", lambda request, *a, **kw: sent.append(request) or submit(request, *a, **kw))
    plain = list(mem.add(facts=FACTS, user_id="map-ctx").ids)
    turns = list(mem.add([{"role": "user", "content": "We moved to Porto last spring."},
                          {"role": "assistant", "content": "How do you like it?"},
                          {"role": "user", "content": "My sister adopted a puppy named Bruno there."}],
                         user_id="map-ctx").ids)
    assert mem.get(turns[-1]).context  # encoded after the turns before it
    q = "What is my sister's puppy called?"
    mem.chat(q, user_id="map-ctx", fact_ids=plain, mode="kv", max_tokens=1)
    over_plain = sent[-1].plan.map_from
    over_turns = mem.chat(q, user_id="map-ctx", fact_ids=plain + turns, mode="kv", max_tokens=1, logprobs=5)
    assert over_plain == sent[-1].plan.map_from == len(mem.prompts.head_ids)
    unmapped = mem.chat(q, user_id="map-ctx", fact_ids=plain + turns, mode="kv", max_tokens=1, logprobs=5, reader=False)
    # The connector reports it mapped the facts (no LoRA here), and the reply's first token moved.
    assert over_turns.reader_adapter and not unmapped.reader_adapter
    shared = set(over_turns.first_logprobs) & set(unmapped.first_logprobs)
    assert shared and max(abs(over_turns.first_logprobs[t] - unmapped.first_logprobs[t]) for t in shared) > 1e-3


def test_a_map_the_models_rotary_does_not_fit_is_refused_and_chats_are_plain_kv(model_dir, tmp_path, caplog,
                                                                                monkeypatch):
    """Phi-3 rotates only half of each head (partial_rotary_factor 0.5), which the map's complex
    multiply does not commute with. Only vLLM's worker sees that; it used to raise there, and
    the engine failed to start. Now the whole adapter is refused with the reason, as a malformed
    one is, and KV-mode chats are served plainly (no map asked for, none reported)."""
    import logging
    from pathlib import Path

    from kvmem.config import KVConfig
    from kvmem.model import resolve_model
    from kvmem.service import KVMem
    from tests.engine.test_families import make_model_dir

    path = make_model_dir(tmp_path, "phi3", Path(model_dir))
    info = resolve_model(str(path), tmp_path / "models")
    folder = tmp_path / "phi3-map"
    lora.save([], folder, rank=8, alpha=16.0, base_model=str(path), meta={"fingerprint": info.fingerprint},
              kv_map=random_map(info.num_layers, info.num_kv_heads, info.head_size, spread=0.1))
    assert adapters.find(str(folder), tmp_path / "home", info.fingerprint) == folder  # it passes every file check
    config = Config(home=tmp_path / "home", engine=EngineConfig(model=str(path), cpu_kv_space_gib=TEST_KV_CACHE_GIB),
                    kv=KVConfig(reader_adapter=str(folder)))
    with caplog.at_level(logging.WARNING, logger="kvmem.engine.llm"):
        mem = KVMem(config, background=False)
    try:
        assert mem.engine.reader_adapter is None
        assert "refused, plain KV mode" in caplog.text and "this model has rotary_dim 32" in caplog.text
        ids = list(mem.add(facts=FACTS, user_id="phi3").ids)
        sent = []  # what vLLM itself is sent
        add = mem.engine._engine.add_request
        monkeypatch.setattr(mem.engine._engine, "add_request",
                            lambda rid, prompt, params, **kw: sent.append((prompt, params, kw)) or add(rid, prompt, params, **kw))
        kv = mem.chat("Where do I live?", user_id="phi3", fact_ids=ids, mode="kv", max_tokens=1)
        assert kv.injected_tokens > 0 and kv.fallbacks == 0 and not kv.reader_adapter
        ((prompt, params, kw),) = sent
        assert kw.get("lora_request") is None and not prompt["cache_salt"].endswith(":reader")
        assert "map_from" not in params.extra_args["kv_transfer_params"][KEY]
    finally:
        mem.close()
