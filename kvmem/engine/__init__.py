"""The only package that imports vLLM (lazily: importing kvmem.engine alone does not).

connector.py       the KV connector class vLLM loads (scheduler side + worker side)
support.py         what the connector refuses at start-up (TP/PP > 1, MLA, fp8 caches, hybrid groups)
scheduler_side.py  which prompt tokens to claim, load and save plans, delayed block frees
worker_side.py     paged-cache writes (injection) and reads (encoding), on the cache's device
staging.py         side stream, events and the reusable pinned host buffer (synchronous on CPU)
blob_writer.py     the worker-process thread that writes encoded blobs off the engine step
paged.py           a layout-calibrated gather from any backend's paged cache
rope.py            rotating stored pre-RoPE keys with vLLM's own rotary embedding
plan.py            the kv_transfer_params wire format and the connector's per-step metadata (plain Python)
prompt.py          prompt assembly from separately tokenized segments (no vLLM)
llm.py             starting vLLM and running requests with timings
"""
