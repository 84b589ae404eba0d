"""The only package that imports vLLM (lazily: importing kvmem.engine alone does not).

connector.py       the KV connector class vLLM loads (scheduler side + worker side)
scheduler_side.py  which prompt tokens to claim, load and save plans
worker_side.py     paged-cache writes (injection) and reads (encoding)
paged.py           a layout-calibrated gather from any backend's paged cache
rope.py            rotating stored pre-RoPE keys with vLLM's own rotary embedding
plan.py            the kv_transfer_params wire format (plain Python)
prompt.py          prompt assembly from separately tokenized segments (no vLLM)
llm.py             starting vLLM and running requests with timings
"""
