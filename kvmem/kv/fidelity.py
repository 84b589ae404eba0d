"""Named points on KV mode's fidelity/speed curve: `kv.fidelity`, or per chat `memory.fidelity`.

A user picks how close to text prefill's answers KV mode should come, not a recompute fraction
and rule: each point sets kv.recompute, kv.recompute_rule and kv.text_facts together.

- "fast": plain injection (read through the reader's KV map where one ships): the TTFT headline;
  answers part from text prefill's more often than text parts from itself.
- "balanced": 15% of each fact's tokens recomputed, those whose keys moved most (CacheBlend's
  budget and rule): closer answers for a share of a prefill's compute.
- "exact": every fact token recomputed through the engine's own attention kernel: text prefill's
  arithmetic (bit for bit wherever vLLM's own prefix-cache hit is), at text prefill's compute.
  What it keeps over text mode is none of the TTFT, only the memory layer's retrieval and API.

Measured quality and speed of each on the bundled model: docs/benchmarks.md, "Fidelity points".
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmem.kv.recompute import Recompute


@dataclass(frozen=True)
class Fidelity:
    recompute: Recompute
    text_facts: int = 0


POINTS: dict[str, Fidelity] = {
    "fast": Fidelity(Recompute(0.0)),
    "balanced": Fidelity(Recompute(0.15, "deviation")),
    "exact": Fidelity(Recompute(1.0, "first")),
}


def point(name: str) -> Fidelity:
    """The named point; ValueError naming the choices for anything else."""
    if not isinstance(name, str) or name not in POINTS:
        raise ValueError(f"fidelity must be one of {tuple(POINTS)}, got {name!r}")
    return POINTS[name]
