#!/usr/bin/env bash
# Issue 11, gpt-oss on one H200: the gpt-oss CUDA tests (prompt, decode gather and CUDA graphs against
# the CPU), then `strata bench` on the gpt-oss-120b preset with 8 of its 36 layers (1024 MXFP4
# experts of 13.2 MB, ~15 GB) with half and then all of the experts cached.
# Run from the repo root on the device machine with the wheels of .whl carried:
#   OUT=$OUT bash tools/gpu_arch_gptoss.sh
set -x
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
OUT=${OUT:-/tmp/out}; MODEL=/tmp/oss120.gguf
if ! python3 -c "import strata_core" 2> /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/layer_split -e plugins/prefill_main \
    > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
fi
[ -f $MODEL ] || (/usr/bin/time -f "make-synthetic %e s" strata make-synthetic --preset gpt-oss-120b --layers 8 \
  $MODEL > "$OUT/oss-make.log" 2>&1 &)
timeout 60 python3 -m pytest -q -x tests/test_gpt_oss_cuda.py 2>&1 | tee "$OUT/oss-tests.log" | tail -15
while pgrep -f "make-synthetic --preset gpt-oss" > /dev/null; do sleep 1; done
tail -2 "$OUT/oss-make.log"; ls -la $MODEL
strata info $MODEL 2>&1 | tee "$OUT/oss-info.log" | tail -22
# 512 of the 1024 experts cached (the rest streamed / read over the host link), then every expert resident
for CACHE in 512 1024; do
  timeout 55 strata bench --model $MODEL --devices cuda:0 --expert-cache $CACHE --arena pinned --cuda-graphs \
    --prompts 4k --contexts 1k --decode-tokens 16 --repeats 1 --sessions 1,4 2>&1 \
    | tee -a "$OUT/oss-bench-$CACHE.log" | grep -v "^INFO\|^WARNING" | tail -8
done
