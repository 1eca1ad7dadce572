#!/usr/bin/env bash
# Issue 11, deepseek2 on one H200: the MLA CUDA tests, then `strata bench` on the deepseek-v3-small
# preset (DeepSeek-V3 widths, 4 of its 61 layers: 1 dense + 3 MoE, 768 Q4_K experts, ~19 GB).
# Run from the repo root on the device machine with the wheels of .whl carried:
#   OUT=$OUT bash tools/gpu_arch_deepseek.sh        (CACHES="384 768" adds an all-resident run)
set -x
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
OUT=${OUT:-/tmp/out}; MODEL=/tmp/ds3.gguf
if ! python3 -c "import strata_core" 2> /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/layer_split -e plugins/prefill_main \
    > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
fi
[ -f $MODEL ] || (start=$(date +%s); strata make-synthetic --preset deepseek-v3-small --expert-type Q4_K $MODEL \
  > "$OUT/ds-make.log" 2>&1; echo "make-synthetic: $(( $(date +%s) - start )) s" >> "$OUT/ds-make.log") &
timeout 120 python3 -m pytest -q -x tests/test_deepseek2_cuda.py 2>&1 | tee "$OUT/ds-tests.log" | tail -15
while pgrep -f "make-synthetic --preset deepseek" > /dev/null; do sleep 1; done
cat "$OUT/ds-make.log" | tail -2; ls -la $MODEL
strata info $MODEL 2>&1 | tee "$OUT/ds-info.log" | tail -20
# CACHES: expert slots (384 of the 768 experts: half of them streamed / read over the host link)
for CACHE in ${CACHES:-384}; do
  timeout 150 strata bench --model $MODEL --devices cuda:0 --expert-cache $CACHE --arena pinned --cuda-graphs \
    --prompts 4k --contexts 1k --decode-tokens 32 --repeats 2 --sessions 1,4 2>&1 \
    | tee -a "$OUT/ds-bench-$CACHE.log" | grep -v "^INFO\|^WARNING" | tail -8
done
