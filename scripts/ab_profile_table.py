"""The connector's stages per run of an A/B (`scripts/ab_ttft.sh ... --profile`), as a Markdown table.

    python scripts/ab_profile_table.py OUT_DIR   # OUT_DIR as given to ab_ttft.sh

Per run (before-1, after-1, ...) and k > 0: KV mode's and the floor's median TTFT, their ratio, the
main worker stages, the connector's total (connector/profile.py's `work_total`: premap, nested in
staging, once) and the injecting step's forward pass after the load.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvmem.connector.profile import work_total


def table(out: Path) -> list[str]:
    lines = ["| run | k | kv ms | facts hit ms | kv/facts hit | blob_reads | staging | placement | scatter "
             "| connector total | forward |", "|---" * 11 + "|"]
    for f in sorted(out.glob("*-*/ttft*.json")):
        for r in json.loads(f.read_text())["rows"]:
            if not r["k"] or "profile" not in r:
                continue
            ms = r["profile"]["connector_ms"]
            cells = [f"{ms.get(n, 0.0):.2f}" for n in ("blob_reads", "staging", "placement", "scatter")]
            forward = f"{ms['forward']:.1f}" if "forward" in ms else "-"
            lines.append(f"| {f.parent.name} | {r['k']} | {r['kv']['median'] * 1e3:.1f} | "
                         f"{r['facts_hit']['median'] * 1e3:.1f} | {r['kv_over_facts_hit']:.2f} | " + " | ".join(cells)
                         + f" | {work_total(ms):.1f} | {forward} |")
    return lines


if __name__ == "__main__":
    print("\n".join(table(Path(sys.argv[1]))))
