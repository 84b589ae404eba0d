"""Code that runs inside vLLM's processes: the KV connector and what it needs.

vLLM loads `kvmem.connector.connector.KvmemConnector` by module path in its scheduler process and
in each worker process. Nothing here imports kvmem's clients (engine/, service, server): the
clients reach this code only through vLLM, with the wire types of plan.py.

connector.py       the KV connector class vLLM loads (scheduler side + worker side)
plan.py            the wire: a request's Plan, the connector's reply and settings, per-step metadata
support.py         what the connector refuses at start-up (TP/PP > 1, MLA, fp8 caches, hybrid groups)
scheduler_side.py  which prompt tokens to claim, load and save plans, delayed block frees
worker_side.py     paged-cache writes (injection) and reads (encoding), on the cache's device
staging.py         side stream, events and the reusable pinned host buffer (synchronous on CPU)
blob_writer.py     the worker-process thread that writes encoded blobs off the engine step
paged.py           a layout-calibrated gather from any backend's paged cache
rope.py            rotating stored pre-RoPE keys with vLLM's own rotary embedding
"""
