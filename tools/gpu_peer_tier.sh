#!/usr/bin/env bash
# Issue 9's GPU run (two GPUs): the peer CUDA tests (the head split, spans, grouped prefill, routing read
# too), `strata bench` of single and peer_tier with CACHE expert slots per device (2048 of 6,144: a third),
# REPEATS runs a figure (3: `single`'s 8K moves ~20% between machines, so compare within one run),
# `strata gate` of all five strategies, the prompt of peer_tier reading the peer's cache across instead
# (peer_prefill_rows=0) and streaming 65% of the misses on the peer, gpu1_experts, peer_tier's profile, then
# layer_split and prefill_main. One model-loading process at a time (several at
# once stall every load); deadline-bounded; logs under $OUT/logs.tgz as it goes (a call returns 8 files).
# From the repo root on the device machine with .whl carried:
#   bash tools/gpu_peer_tier.sh      (LONG=1: 32K prompts and contexts in the single / peer_tier benches)
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=12 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; L=/tmp/logs; mkdir -p $L "$OUT"; CACHE=${CACHE:-2048}; MODEL=/tmp/q30.gguf; PAIR=${PAIR:-cuda:0,cuda:1}
T0=$(date +%s)
step() { echo "[t=$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/steps.log"; tar czf "$OUT/logs.tgz" -C $L .; }
left() { echo $(( ${DEADLINE:-560} - ($(date +%s) - T0) )); }
lim() { local l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/layer_split -e plugins/prefill_main \
  -e plugins/peer_tier -e plugins/gpu1_experts > "$L/pip.log" 2>&1 || { tail "$L/pip.log"; exit 1; }
[ -f $MODEL ] || (strata make-synthetic --preset qwen3-30b-a3b --expert-type Q4_K $MODEL > "$L/synth.log" 2>&1 &)
nvidia-smi topo -m > "$L/topo.txt"
timeout "$(lim 120)" python3 -m pytest -q tests/test_peer_pairs.py tests/test_moe_served.py tests/test_head_split.py \
  tests/test_spans.py tests/test_grouped_prefill.py tests/test_pending_read.py plugins -k "cuda or CUDA" \
  > "$L/tests.log" 2>&1; step "peer CUDA tests rc=$?"
while [ ! -f $MODEL ] || pgrep -f make-synthetic > /dev/null; do sleep 1; done
prompts=8k; contexts=1k; [ -n "${LONG:-}" ] && prompts=8k,32k contexts=1k,32k
bench() {  # bench NAME STRATEGY PROMPTS CONTEXTS SESSIONS [OPTIONS]: one strategy's figures, alone on the machine
  local devices=$PAIR opts=(); [ "$2" = single ] && devices=cuda:0; [ -n "${6:-}" ] && opts=(--strategy-options "$6")
  timeout "$(lim 150)" strata bench --model $MODEL --strategy "$2" --devices "$devices" --expert-cache "$CACHE" \
    --arena pinned --prompts "$3" --contexts "$4" --decode-tokens 32 --repeats "${REPEATS:-3}" --sessions "$5" \
    --max-context 33000 "${opts[@]}" > "$L/bench-$1.log" 2>&1; step "bench $1 rc=$?"
}
bench single single $prompts $contexts 1,4
bench peer_tier peer_tier $prompts $contexts 1,4
timeout "$(lim 150)" strata gate --model $MODEL --strategies single,peer_tier,gpu1_experts,layer_split,prefill_main \
  --devices "$PAIR" --arena pinned --experts 4032 --tokens ${GATE_TOKENS:-8} --max-context 512 > "$L/gate.log" 2>&1; step "gate rc=$?"
bench peer_tier-across peer_tier 8k 1k 1 peer_prefill_rows=0
bench peer_tier-stream65 peer_tier 8k 1k 1 peer_stream_frac=0.65
bench gpu1_experts gpu1_experts 8k 1k 1
timeout "$(lim 70)" python3 tools/profile_decode.py $MODEL --strategy peer_tier --devices $PAIR --expert-cache $CACHE \
  --cuda-graphs --windows 8 --top 14 --prefill 8192 --warm-prefill > "$L/profile-peer.log" 2>&1; step "peer profile rc=$?"
bench layer_split layer_split 8k 1k 1
bench prefill_main prefill_main 8k 1k 1
tail -2 "$L/tests.log"; grep -E "IDENTICAL|DIFFERS" "$L/gate.log"
for f in "$L"/bench-*.log; do echo "== $f"; grep -E "^\| (prefill|decode)" "$f"; done
grep -E "wall|per device|host time" "$L/profile-peer.log" | cut -c1-160
