"""`add(messages, infer=True)`: facts extracted by an LLM and reconciled with the stored ones.

prompts.py (the prompts and their JSON schemas), llm.py (the served model or an OpenAI-compatible
API), decide.py (reading the replies, ids by alias), infer.py (the flow); the batch is applied
by kvmem.writes.apply_changes.
"""
