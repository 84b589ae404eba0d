"""The reader of injected KV: measuring where KV mode parts from text prefill, and the reader
adapter (trained by `kvmem tune-reader`) that KV-mode chats read injected facts with: a KV map of
the facts' keys and values (kvmap.py), a LoRA on the reader's projections (lora.py), or both.

No vLLM here: `lab` rebuilds KV mode in PyTorch (transformers) to diagnose and train; the engine
only loads the adapter folder that `adapters.find` picks for the served model.
"""
