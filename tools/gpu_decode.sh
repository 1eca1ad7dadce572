#!/usr/bin/env bash
# Issue 7's GPU run (one H200): the decode kernels' CUDA tests, `strata bench` all resident and half
# resident (the BENCHMARKS.md commands), the decode profile with replayed graphs, and, with LLAMACPP
# set to a copy of /work/shared/llamacpp-peer inside the checkout (git-ignored, carried), llama.cpp
# built in the background while Strata runs and benched after it, so the ratios are from one run.
# From the repo root on the device machine, .whl (and the llama.cpp folder) carried:
#   LLAMACPP=.llamacpp bash tools/gpu_decode.sh        # ~9 min with llama.cpp's build, ~5 without
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; MODEL=/tmp/q30.gguf; LLAMA_OUT=/tmp/llamacpp-out
if [ -n "${LLAMACPP:-}" ]; then  # its own OUT: llama.cpp's results must not land in this run's OUT
  (OUT=$LLAMA_OUT nice -n 10 bash "$LLAMACPP/llamacpp.sh" env build > "$OUT/llamacpp-build.log" 2>&1; echo "build rc $?" \
    >> "$OUT/llamacpp-build.log") &
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
[ -f $MODEL ] || (strata make-synthetic --preset qwen3-30b-a3b --expert-type Q4_K $MODEL > "$OUT/synth.log" 2>&1 &)
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -n 8 ${TESTS_PATHS:-tests/test_decode_ops_cuda.py \
  tests/test_fused_decode.py tests/test_cuda_graphs.py tests/test_decode_sync_cuda.py tests/test_kernels_cuda.py} 2>&1 \
  | tee "$OUT/tests.log" | grep -E "passed|failed|^FAILED|^ERROR" | tail -15
while pgrep -f make-synthetic > /dev/null; do sleep 1; done
B="strata bench --model $MODEL --devices cuda:0 --prompts 8k --contexts 1k --repeats 2 --arena pinned --max-context 8500"
for cache in ${CACHES:-6144 3072}; do
  timeout 150 $B --expert-cache "$cache" --cuda-graphs --decode-tokens 256 2>&1 | tee -a "$OUT/bench.log" \
    | grep -E "^\||^settings"
done
timeout 100 python3 tools/profile_decode.py $MODEL --context 1024 --windows 8 --cuda-graphs --top 24 2>&1 \
  | grep -E "^ +[0-9.]+ ms|wall|host time" | tee "$OUT/profile.log"
if [ -n "${LLAMACPP:-}" ]; then
  wait
  tail -3 "$OUT/llamacpp-build.log"
  OUT=$LLAMA_OUT timeout 300 bash "$LLAMACPP/llamacpp.sh" bench $MODEL gpu cmoe24-pin > "$OUT/llamacpp-bench.log" 2>&1
  cp $LLAMA_OUT/bench.md "$OUT/llamacpp-bench.md" && cat "$OUT/llamacpp-bench.md"
fi
