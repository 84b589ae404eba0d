#!/usr/bin/env bash
# The hot path before and after a change, side by side in one run: `kvmem bench ttft` from two
# checkouts, alternating (A B A B), each with its own output folder; then the ratios per run.
#   scripts/ab_ttft.sh BEFORE_CHECKOUT AFTER_CHECKOUT OUT_DIR [ROUNDS] [bench ttft args...]
# e.g. git worktree add /tmp/before <commit>; scripts/ab_ttft.sh /tmp/before . /tmp/ab 2 --ks 0,50 --reps 7 \
#   --data PATH/locomo_dev.json
# Pass --data: without it, checkouts from issue 52 on read the synthetic tuning set kvmem ships
# (ttft-synthetic.json) and older ones LoCoMo, so the two sides would not read the same facts.
set -euo pipefail
before=$(cd "$1" && pwd); after=$(cd "$2" && pwd); out=$3; rounds=${4:-2}; shift 4 || shift $#
py=${PYTHON:-$after/.venv/bin/python}
mkdir -p "$out"
for i in $(seq 1 "$rounds"); do
  for side in before after; do
    tree=$before; [ "$side" = after ] && tree=$after
    echo "== round $i: $side ($tree)"
    (cd "$tree" && PYTHONPATH="$tree" "$py" -m kvmem.cli bench ttft --out "$out/$side-$i" "$@" > "$out/$side-$i.log" 2>&1)
  done
done
"$py" - "$out" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'run':<10} {'k':>4} {'text ms':>9} {'kv ms':>8} {'text/kv':>8} {'kv/cached':>9} {'kv/facts hit':>12}")
for f in sorted(out.glob("*-*/ttft*.json")):
    for row in json.loads(f.read_text())["rows"]:
        t, kv = row["text"]["median"] * 1e3, row["kv"]["median"] * 1e3
        print(f"{f.parent.name:<10} {row['k']:>4} {t:>9.1f} {kv:>8.1f} {row['ratio_median']:>8.2f} "
              f"{row['kv_over_cached']:>9.2f} {row['kv_over_facts_hit']:>12.2f}")
PY
