#!/usr/bin/env bash
# Issue 9's GPU run (two GPUs): the peer_tier / gpu1_experts CUDA tests, `strata bench` for single and
# the four two-device strategies with CACHE expert slots per device (2048 of 6,144: a third), and
# `strata gate` across all of them. Run from the repo root on the device machine with .whl carried:
#   TESTS=1 bash tools/gpu_peer_tier.sh   (PAIR=cuda:0,cuda:0 on one GPU; LONG: strategies also at 32K)
set -x
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=/tmp/site
OUT=${OUT:-/tmp/out}; CACHE=${CACHE:-2048}; MODEL=/tmp/q30.gguf; PAIR=${PAIR:-cuda:0,cuda:1}
if ! python3 -c "import strata_peer_tier" 2> /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/layer_split -e plugins/prefill_main \
    -e plugins/peer_tier -e plugins/gpu1_experts > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
fi
[ -f $MODEL ] || (strata make-synthetic --preset qwen3-30b-a3b --expert-type Q4_K $MODEL > /dev/null 2>&1 &)
if [ -n "${TESTS:-}" ]; then  # beside the gate (both check correctness; the benches run alone after)
  nvidia-smi topo -m > "$OUT/topo.txt"
  timeout ${TEST_S:-120} python3 -m pytest -q -k cuda plugins/peer_tier plugins/gpu1_experts > "$OUT/tests.log" 2>&1 &
fi
while pgrep -f make-synthetic > /dev/null; do sleep 1; done
if [ -z "${NO_GATE:-}" ]; then
  timeout ${GATE_S:-120} strata gate --model $MODEL --devices "$PAIR" --arena pinned --cuda-graphs --experts 4032 \
    --tokens ${GATE_TOKENS:-12} --max-context 512 2>&1 | tee "$OUT/gate.log" | grep -v "^INFO\|^WARNING"
fi
wait
[ -f "$OUT/tests.log" ] && tail -12 "$OUT/tests.log"
for run in ${STRATEGIES:-single peer_tier gpu1_experts layer_split prefill_main}; do
  devices=$PAIR; [ "$run" = single ] && devices=cuda:0
  prompts=8k; case " ${LONG:-single peer_tier} " in *" $run "*) prompts=8k,32k;; esac
  timeout ${BENCH_S:-60} strata bench --model $MODEL --strategy "$run" --devices "$devices" --expert-cache "$CACHE" \
    --arena pinned --cuda-graphs --prompts "$prompts" --contexts 1k --decode-tokens 32 --repeats 2 --sessions 1,4 \
    --max-context 33000 2>&1 | tee -a "$OUT/bench.log" | grep -v "^INFO\|^WARNING" | tail -6
done
