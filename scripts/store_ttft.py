"""TTFT of a chat that writes its turns back (store="both") against one that does not, paired and
alternating in one process: the write happens after the reply, so the ratio should be ~1.
    .venv/bin/python scripts/store_ttft.py
"""
import statistics, uuid
from pathlib import Path
from kvmem.config_overlay import resolve
from kvmem.service import KVMem
cfg = resolve(flags={"home": "/tmp/storettft"}).config
with KVMem(cfg) as mem:
    user = f"st-{uuid.uuid4().hex[:6]}"
    mem.add(facts=[f"Fact number {i}: I visited city {i} in spring." for i in range(20)], user_id=user)
    for _ in range(3):
        mem.chat("Warm up?", user_id=user, k=5, max_tokens=2)
    pairs = []
    for i in range(20):
        order = ("none", "both") if i % 2 == 0 else ("both", "none")
        got = {}
        for store in order:
            r = mem.chat(f"Which city did I visit, question {i} {store}?", user_id=user, k=5, max_tokens=8, store=store)
            got[store] = r.ttft_s
        pairs.append(got["both"] / got["none"])
    mem.encode_pending(120)
    pairs.sort()
    print("RESULT ttft(store=both)/ttft(store=none) median", round(statistics.median(pairs), 3),
          "p10-p90", round(pairs[2], 3), round(pairs[-3], 3), "n", len(pairs), "facts now", mem.facts.count(user_id=user))
