"""Clients of vLLM: starting it with kvmem's connector and running requests (no connector code:
that runs inside vLLM's processes and lives in kvmem.connector).

llm.py       the in-process engine: vLLM started here, requests run with timings
remote.py    the same interface over HTTP to a `kvmem replica` (stock `vllm serve`)
protocol.py  the Engine protocol both implement, and the request/result types
start.py     the engine a configuration asks for
replica.py   the vLLM configuration a replica is started with
health.py    probing replicas
prompt.py    prompt assembly from separately tokenized segments (no vLLM)
"""
