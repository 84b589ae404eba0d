#!/usr/bin/env bash
# The prepared device check, run ON the GPU machine from the repo root, after the pieces made by
# scripts/gpu_bundle.sh were copied into PARTS (one `run` call per piece; scripts/GPU.md):
#
#   bash scripts/gpu_check.sh [PARTS] [OUT]        (defaults: /tmp/kvmem-gpu and $OUT)
#
# 1. unpacks vLLM and kvmem's missing packages into /tmp/kvmem-site (no network, no pip);
# 2. runs tests/gpu/ (paged round trip on FlashAttention's layout, rotary kernel, worker encode ->
#    inject with side stream and pinned staging, and the engine oracles: k=1, true-prefix k=10,
#    fallback, isolation) on the bundled SmolLM2-135M;
# 3. runs `kvmem bench ttft` (k = 0, 10, 50, 100; text vs kv vs the engine's own prefix-cache hit)
#    for SmolLM2-135M (real weights) and a Llama-3.1-8B-shaped model (load_format=dummy), the
#    latter with selective recompute of 15% of the fact tokens (kv.recompute): its table has kv
#    with recompute and "kv_all" (plain injection) side by side.
# Each step has its own time limit; the whole check stays under 8 minutes. Results: OUT/steps.log,
# OUT/gpu-tests.log, OUT/smollm2/ttft.json, OUT/llama8b/ttft.json (+ their PNG and markdown).
set -uo pipefail
cd "$(dirname "$0")/.."
parts=${1:-/tmp/kvmem-gpu}
out=${2:-${OUT:-/tmp/kvmem-gpu-out}}
site=/tmp/kvmem-site
mkdir -p "$out"
step() { echo "[gpu_check +$((SECONDS))s] $*" | tee -a "$out/steps.log"; }

step "unpack"
if [ ! -f "$site/.unpacked" ]; then
  (cd "$parts" && sha256sum -c --quiet SHA256SUMS) || { step "pieces missing or corrupt in $parts"; exit 2; }
  mkdir -p "$site"
  # Python's lzma, since the image may have no xz binary.
  cat "$parts"/site.tar.xz.part* | python3 -c "
import lzma, sys, tarfile
with tarfile.open(fileobj=lzma.open(sys.stdin.buffer), mode='r|') as t:
    t.extractall('$site', filter='fully_trusted')" || { step "unpack failed"; exit 2; }
  touch "$site/.unpacked"
fi
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 KVMEM_HOME=/tmp/kvmem-home VLLM_NO_USAGE_STATS=1
bash scripts/gpu/preflight.sh > "$out/preflight.txt" 2>&1
python3 -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())" \
  2>&1 | tee -a "$out/steps.log" || { step "vLLM does not import; see scripts/GPU.md for the fallback"; exit 3; }

step "models"
timeout 120 python3 - <<'EOF' 2>&1 | tee -a "$out/steps.log"
import json, shutil
from pathlib import Path
from kvmem.config import default_home
from kvmem.model import resolve_model

small = resolve_model(None, default_home() / "models").path          # converts the bundled GGUF once
big = default_home() / "models" / "llama-3.1-8b-shape"              # config + SmolLM2's tokenizer: dummy weights
big.mkdir(parents=True, exist_ok=True)
shutil.copy("scripts/gpu/llama-3.1-8b-config.json", big / "config.json")
for f in small.iterdir():
    if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "generation_config.json"):
        shutil.copy(f, big / f.name)
print("models:", small, big)
EOF

step "tests/gpu"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu -o addopts="" -rA > "$out/gpu-tests.log" 2>&1
step "tests/gpu exit $? ($(tail -1 "$out/gpu-tests.log"))"

bench() {  # name, timeout, extra kvmem args...
  local name=$1 limit=$2
  shift 2
  step "bench ttft $name"
  KVMEM_ENFORCE_EAGER=1 timeout "$limit" python3 -m kvmem.cli "$@" bench ttft --ks 0,10,50,100 --reps 5 \
    --data "$parts/locomo_dev.json" --out "$out/$name" > "$out/bench-$name.log" 2>&1
  step "bench ttft $name exit $?"
}
bench smollm2 90
KVMEM_KV_RECOMPUTE=0.15 KVMEM_LOAD_FORMAT=dummy bench llama8b 180 --model "$KVMEM_HOME/models/llama-3.1-8b-shape"
step "done"
