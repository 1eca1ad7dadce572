#!/usr/bin/env bash
# Issue 11, gpt-oss on one H200 (~60 s of work alone; timeouts leave room for three scripts sharing
# one GPU): the gpt-oss CUDA tests (fused kernels with biases, prompt, decode gather and CUDA
# graphs against the CPU), then `strata bench` on the gpt-oss-120b preset with 4 of its 36 layers (512
# MXFP4 experts of 13.2 MB, ~8 GB), 256 of them cached (the rest streamed / read over the host link);
# a 1k prompt, decode at a 512-token context for 1 and 4 sessions.
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
[ -f $MODEL ] || (strata make-synthetic --preset gpt-oss-120b --layers 4 $MODEL > "$OUT/oss-make.log" 2>&1 &)
timeout 90 python3 -m pytest -q --tb=short tests/test_gpt_oss_cuda.py 2>&1 | tee "$OUT/oss-tests.log" | tail -15
while pgrep -f "make-synthetic --preset gpt-oss" > /dev/null; do sleep 1; done
tail -1 "$OUT/oss-make.log"; ls -la $MODEL
timeout 20 strata info $MODEL 2>&1 | tee "$OUT/oss-info.log" | grep -v "^  " | tail -8
timeout 100 strata bench --model $MODEL --devices cuda:0 --expert-cache 256 --arena pinned --cuda-graphs \
  --prompts 1k --contexts 512 --decode-tokens 8 --repeats 1 --sessions 1,4 2>&1 \
  | tee "$OUT/oss-bench-256.log" | grep -v "^INFO\|^WARNING" | tail -8
