"""The reader adapter's serving format: what KV-mode chats read injected facts with, a KV map of
the facts' keys and values (kvmap.py), a LoRA on the reader's projections (lora.py), or both, and
`adapters.find`, which picks the folder for the served model. Trained offline by kvmem.tune.
"""
