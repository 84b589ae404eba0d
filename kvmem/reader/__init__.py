"""The reader of injected KV: measuring where KV mode parts from text prefill, and a query-side
LoRA adapter (trained by `kvmem tune-reader`) that KV-mode chats read injected facts with.

No vLLM here: `lab` rebuilds KV mode in PyTorch (transformers) to diagnose and train; the engine
only loads the adapter folder that `adapters.find` picks for the served model.
"""
