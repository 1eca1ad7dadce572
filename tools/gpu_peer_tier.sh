#!/usr/bin/env bash
# Issue 9's GPU run (two GPUs): the peer_tier / gpu1_experts CUDA tests, `strata gate` across all five
# strategies, `strata bench` of single and the two-device strategies with CACHE expert slots per device
# (2048 of 6,144: a third), each alone (one model-loading process at a time: several at once stall every
# load), and the profiles of peer_tier's decode and prompt. Deadline-bounded; logs under $OUT as it goes.
# From the repo root on the device machine with .whl carried:
#   bash tools/gpu_peer_tier.sh      (STRATEGIES: the strategies benched after single and peer_tier; LONG: 32K context)
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=12 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; CACHE=${CACHE:-2048}; MODEL=/tmp/q30.gguf; PAIR=${PAIR:-cuda:0,cuda:1}; T0=$(date +%s)
step() { echo "[t=$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/steps.log"; }
left() { echo $(( ${DEADLINE:-570} - ($(date +%s) - T0) )); }
lim() { local l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/layer_split -e plugins/prefill_main \
  -e plugins/peer_tier -e plugins/gpu1_experts > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
[ -f $MODEL ] || (strata make-synthetic --preset qwen3-30b-a3b --expert-type Q4_K $MODEL > "$OUT/synth.log" 2>&1 &)
nvidia-smi topo -m > "$OUT/topo.txt"
timeout "$(lim 70)" python3 -m pytest -q -k cuda plugins/peer_tier plugins/gpu1_experts > "$OUT/tests.log" 2>&1
step "plugin CUDA tests rc=$?"
while [ ! -f $MODEL ] || pgrep -f make-synthetic > /dev/null; do sleep 1; done
timeout "$(lim 110)" strata gate --model $MODEL --devices "$PAIR" --arena pinned --cuda-graphs --experts 4032 \
  --tokens ${GATE_TOKENS:-8} --max-context 512 > "$OUT/gate.log" 2>&1; step "gate rc=$?"
contexts=1k; [ -n "${LONG:-}" ] && contexts=1k,32k
bench() {  # bench STRATEGY: one strategy's figures, alone on the machine
  local devices=$PAIR; [ "$1" = single ] && devices=cuda:0
  timeout "$(lim 80)" strata bench --model $MODEL --strategy "$1" --devices "$devices" --expert-cache "$CACHE" \
    --arena pinned --cuda-graphs --prompts 8k,32k --contexts $contexts --decode-tokens 32 --repeats 2 --sessions 1,4 \
    --max-context 33000 > "$OUT/bench-$1.log" 2>&1; step "bench $1 rc=$?"
}
bench single; bench peer_tier  # the same-run ratio first, then the profiles, then the other strategies
P="python3 tools/profile_decode.py $MODEL --strategy peer_tier --devices $PAIR --expert-cache $CACHE --cuda-graphs"
timeout "$(lim 60)" $P --windows 16 --top 16 > "$OUT/profile-peer-decode.log" 2>&1; step "peer decode profile rc=$?"
timeout "$(lim 70)" $P --windows 4 --top 20 --prefill 8192 --warm-prefill > "$OUT/profile-peer-prompt.log" 2>&1
step "peer prompt profile rc=$?"
for run in ${STRATEGIES:-gpu1_experts layer_split prefill_main}; do bench "$run"; done
tail -1 "$OUT/tests.log"; grep -E "IDENTICAL|DIFFERS" "$OUT/gate.log"
for f in "$OUT"/bench-*.log; do echo "== $f"; grep -E "^\|" "$f" | tail -4; done
grep -hE "unprofiled|wall|per device|^ +[0-9.]+ ms" "$OUT"/profile-peer-*.log | cut -c1-140 | head -40
