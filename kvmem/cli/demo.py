"""`kvmem demo`: store a short conversation for a demo user, then ask three questions in text and
KV mode with the same retrieved facts, and print both answers with their TTFT (`make demo`)."""

from __future__ import annotations

import argparse

from kvmem.config import Config

DEMO_USER = "demo-user"
DEMO_CONVERSATION = [
    {"role": "user", "content": "Hi! I moved to Porto last month for a new job."},
    {"role": "assistant", "content": "Welcome to Porto! What kind of job brought you there?"},
    {"role": "user", "content": "I am a software engineer at a company that builds signalling systems for trams."},
    {"role": "assistant", "content": "That sounds interesting. Did you move on your own?"},
    {"role": "user", "content": "No, my dog Pepper came with me. She is a three-year-old border collie."},
    {"role": "assistant", "content": "Border collies need a lot of exercise. Does Pepper like the city?"},
    {"role": "user", "content": "She loves the beach at Matosinhos, where we go running every morning."},
    {"role": "assistant", "content": "What a great routine. Do you have family nearby?"},
    {"role": "user", "content": "My sister Marta lives in Braga, an hour away. She teaches the violin."},
    {"role": "assistant", "content": "How lovely. What do you do to relax at the weekend?"},
    {"role": "user", "content": "I paint watercolours of old buildings and sell some at a local market."},
    {"role": "assistant", "content": "Porto's tiled facades must be perfect subjects for that."},
]
DEMO_QUESTIONS = [
    "What is my dog's name?",
    "What does my sister teach?",
    "What do I paint at the weekend?",
]


def cmd_demo(args: argparse.Namespace, config: Config) -> int:
    """Store a short conversation, then ask three questions in text and KV mode with retrieval (k=4)."""
    from kvmem.service import KVMem

    print("kvmem demo: starting vLLM with the kvmem connector (the first run converts the model)...", flush=True)
    with KVMem(config, background=False) as mem:
        mem.delete_all(user_id=DEMO_USER)  # reruns start from the same empty memory
        added = mem.add(DEMO_CONVERSATION, user_id=DEMO_USER, window=2)
        report = added.encode
        per_token = mem.model.kv_bytes_per_token(config.kv.codec)
        print(f"\nmodel {mem.model.path.name} ({mem.model.num_layers} layers, {mem.model.num_kv_heads} KV heads x "
              f"{mem.model.head_size}); KV {per_token:,} bytes/token; encoded {report.encoded} facts "
              f"({len(DEMO_CONVERSATION)} turns, window 2) in {report.seconds:.2f} s")
        adapter = mem.status().engine.reader_adapter
        print(f"KV mode reads with the reader adapter {adapter}" if adapter else "KV mode without a reader adapter")
        for mode in ("text", "kv"):  # warm-up, not timed: a fresh engine's first requests pay one-off costs
            mem.chat("Hello!", user_id=DEMO_USER, k=4, mode=mode, max_tokens=1)
        for question in DEMO_QUESTIONS:
            text = mem.chat(question, user_id=DEMO_USER, k=4, mode="text", max_tokens=48)
            kv = mem.chat(question, user_id=DEMO_USER, k=4, mode="kv", max_tokens=48)
            print(f"\nQ: {question}   ({kv.prompt_tokens} prompt tokens, {len(kv.fact_ids)} facts retrieved)")
            for i, fact_id in enumerate(kv.fact_ids, 1):
                print(f"  {i}. {mem.get(fact_id).text}")
            cached = f", {text.cached_tokens} from vLLM's prefix cache" if text.cached_tokens else ""
            print(f"  text  TTFT {text.ttft_s * 1000:7.1f} ms | {_one_line(text.answer)}")
            print(f"  kv    TTFT {kv.ttft_s * 1000:7.1f} ms | {_one_line(kv.answer)}")
            print(f"        TTFT text/kv = {text.ttft_s / kv.ttft_s:.1f}x; {kv.injected_tokens} tokens injected, "
                  f"{kv.fallbacks} fallbacks (text mode: {text.prompt_tokens} prompt tokens{cached})")
    return 0


def _one_line(text: str) -> str:
    return " ".join(text.split())


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="store a short conversation, ask three questions in text and KV mode",
                       description="Store a 12-turn conversation for a demo user, then ask three questions "
                                   "in text and KV mode with k=4 retrieved facts, timing both.")
    p.set_defaults(func=cmd_demo)
