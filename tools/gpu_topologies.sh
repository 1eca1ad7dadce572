#!/usr/bin/env bash
# Issue 8's GPU run (two GPUs): the topology plugins' CUDA tests, then `strata bench` for single,
# layer_split and prefill_main with each of CACHES expert slots per device (1536: a budget that cannot
# hold every expert; 6144: everything resident), decode at 1 and 4 sessions (PAIR: the two devices). Run from the repo root on
# the device machine with the wheels of .whl carried: CACHES="1536 6144" TESTS=1 bash tools/gpu_topologies.sh
set -x
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=/tmp/site
OUT=${OUT:-/tmp/out}; CACHES=${CACHES:-1536 6144}; MODEL=/tmp/q30.gguf
if ! python3 -c "import strata_layer_split" 2> /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/layer_split -e plugins/prefill_main \
    -e examples/strata-even-split > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
fi
[ -f $MODEL ] || (strata make-synthetic --preset qwen3-30b-a3b --expert-type Q4_K $MODEL > /dev/null 2>&1 &)
if [ -n "${TESTS:-}" ]; then
  nvidia-smi topo -m
  timeout 180 python3 -m pytest -q -n 4 ${TESTS_PATHS:-plugins examples tests/test_placement.py \
    tests/test_cuda_graphs.py tests/test_decode_sync_cuda.py} 2>&1 | tee "$OUT/tests.log" | tail -15
fi
while pgrep -f make-synthetic > /dev/null; do sleep 1; done
for CACHE in $CACHES; do
  for run in ${STRATEGIES:-single layer_split prefill_main}; do
    devices=${PAIR:-cuda:0,cuda:1}; [ "$run" = single ] && devices=cuda:0
    timeout 150 strata bench --model $MODEL --strategy "$run" --devices "$devices" --expert-cache "$CACHE" --arena pinned \
      --cuda-graphs --prompts 8k --contexts 1k --decode-tokens 32 --repeats 2 --sessions 1,4 2>&1 \
      | tee -a "$OUT/bench-$CACHE.log" | grep -v "^INFO\|^WARNING" | tail -7
  done
done
