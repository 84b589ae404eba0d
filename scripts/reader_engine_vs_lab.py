"""Does vLLM read with the reader adapter as the PyTorch lab does? (docs/benchmarks.md, issue 10)

Engine (vLLM, bf16, the adapter's KV map applied by the connector and its LoRA, if it has one, as
a LoRA request; facts injected) and lab (transformers, fp32,
kvmem/tune/lab.py) on the same KV-mode chats: 8 questions of the tuning conversation conv-26,
each over 10 of its observations drawn at random. Per chat: each mode's largest log-prob gap
between engine and lab over the engine's top 20, and the adapter's shift of those log-probs
(kv with it minus kv without) in the engine against the lab's: correlation and least-squares
slope (1 when vLLM applies the same adapter the same way).

    .venv/bin/python scripts/reader_engine_vs_lab.py [path/to/locomo_dev.json]
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

import torch

from kvmem.bench import locomo
from kvmem.config import Config, default_home
from kvmem.reader import kvmap, lora
from kvmem.tune.examples import from_records
from kvmem.tune.lab import memory_cache, reply_logits
from kvmem.tune.train import load_model
from kvmem.service import KVMem

MODES = ("text", "kv", "kv+adapter")


def lab_logprobs(model, wrapped, kv_map, ex) -> dict[str, torch.Tensor]:
    """First-token log-probs [vocab] of each mode in the lab."""
    with torch.no_grad():
        with lora.disabled(wrapped):
            text = reply_logits(model, ex, (0,))[0].log_softmax(-1)
            layers = memory_cache(model, ex)
            kv = reply_logits(model, ex, (0,), layers)[0].log_softmax(-1)
        if kv_map is not None:
            layers = kvmap.apply(layers, len(ex.head), len(ex.memory_ids), kv_map)
        adapted = reply_logits(model, ex, (0,), layers)[0].log_softmax(-1)
    return {"text": text, "kv": kv, "kv+adapter": adapted}


def main(data: Path) -> None:
    conv = next(c for c in locomo.load(data) if c["sample_id"] == "conv-26")
    rnd = random.Random(0)
    texts = [f"[{o.date}] {o.text}" for o in rnd.sample(locomo.observations(conv), 40)]
    questions = [q["question"] for q in rnd.sample(locomo.questions(conv), 8)]
    home = Path(tempfile.mkdtemp(prefix="engine-vs-lab-"))
    with KVMem(Config(home=home, models_home=default_home() / "models"), background=False) as mem:
        if mem.engine.reader_adapter is None:
            raise SystemExit("no reader adapter for this model")
        ids = list(mem.add(facts=texts, user_id="u").ids)
        model = load_model(mem.model.path)
        adapter = mem.engine.reader_adapter
        wrapped = []
        if lora.has_lora(adapter):
            peft = json.loads((adapter / "adapter_config.json").read_text())
            wrapped = lora.attach(model, peft["r"], peft["lora_alpha"], tuple(lora.folder_targets(adapter)))
            lora.load_into(wrapped, adapter)
        kv_map = kvmap.load(adapter)
        for q in questions:
            chosen = rnd.sample(ids, 10)
            engine = {m: mem.chat(q, user_id="u", fact_ids=chosen, mode="text" if m == "text" else "kv",
                                  max_tokens=1, logprobs=20, reader=(m == "kv+adapter")).first_logprobs
                      for m in MODES}
            ex = from_records(mem.prompts, [mem.get(i) for i in chosen], [{"role": "user", "content": q}])
            lab = lab_logprobs(model, wrapped, kv_map, ex)
            gaps = {m: max(abs(lp - lab[m][t].item()) for t, lp in engine[m].items()) for m in MODES}
            shared = sorted(set(engine["kv"]) & set(engine["kv+adapter"]))
            e = torch.tensor([engine["kv+adapter"][t] - engine["kv"][t] for t in shared], dtype=torch.float64)
            la = (lab["kv+adapter"] - lab["kv"])[shared].double()
            corr = torch.corrcoef(torch.stack([e, la]))[0, 1].item()
            print(f"{q[:48]:48s} gap " + " ".join(f"{m} {g:.3f}" for m, g in gaps.items())
                  + f" | shift corr {corr:.3f} slope {float(e @ la / (la @ la)):.3f}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else locomo.DEFAULT_PATH)
