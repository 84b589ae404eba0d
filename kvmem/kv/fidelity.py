"""Named points on KV mode's fidelity/speed curve: `kv.fidelity`, or per chat `memory.fidelity`.

A user picks how close to text prefill's answers KV mode should come, not a recompute fraction
and rule: each point sets kv.recompute, kv.recompute_rule and kv.text_facts together.

- "fast": plain injection (read through the reader's KV map where one ships): the TTFT headline;
  answers part from text prefill's more often than text parts from itself.
- "balanced": the last 4 facts prefilled as text after the injected ones, so they attend to every
  fact before them: F1 as text prefill's on the bundled model (retention 0.987 over 650
  questions) for 0.50 of plain injection's TTFT gain at k=50 on a slow-prefill host and 0.71 on a
  fast one (AMX), the cost of 4 facts' prefill whatever k is. It replaced 15% recompute
  (CacheBlend's `deviation`), which kept 0.27 of the gain for answers no closer (the curve in
  docs/benchmarks.md, "The curve at n = 650").
- "exact": every fact token recomputed through the engine's own attention kernel: text prefill's
  arithmetic (bit for bit wherever vLLM's own prefix-cache hit is), at text prefill's compute.
  What it keeps over text mode is none of the TTFT, only the memory layer's retrieval and API.

Measured quality and speed of each on the bundled model: docs/benchmarks.md, "Fidelity points".
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmem.kv.recompute import ENGINE_RULES, Recompute


@dataclass(frozen=True)
class Fidelity:
    recompute: Recompute
    text_facts: int = 0


POINTS: dict[str, Fidelity] = {
    "fast": Fidelity(Recompute(0.0)),
    "balanced": Fidelity(Recompute(0.0), text_facts=4),
    "exact": Fidelity(Recompute(1.0, "first")),
}


def point(name: str) -> Fidelity:
    """The named point; ValueError naming the choices for anything else."""
    if not isinstance(name, str) or name not in POINTS:
        raise ValueError(f"fidelity must be one of {tuple(POINTS)}, got {name!r}")
    return POINTS[name]


def parse(spec: str) -> Fidelity:
    """A point by name (`POINTS`), "text-facts-N" (the last N facts prefilled as text) or a
    recompute setting as its tag, "<rule>-<fraction>" (e.g. "first-0.15"); ValueError else."""
    if spec in POINTS:
        return POINTS[spec]
    if spec.startswith("text-facts-") and spec[len("text-facts-"):].isdigit():
        return Fidelity(Recompute(0.0), int(spec[len("text-facts-"):]))
    rule, _, fraction = spec.rpartition("-")
    if rule in ENGINE_RULES:
        try:
            return Fidelity(Recompute(float(fraction), rule))
        except ValueError:
            pass
    raise ValueError(f"a fidelity point is one of {tuple(POINTS)}, text-facts-N or <rule>-<fraction> with a rule "
                     f"of {ENGINE_RULES} (e.g. first-0.15), got {spec!r}")
