#!/usr/bin/env bash
# The quantized-KV, long-context and speculation figures of BENCHMARKS.md in device calls of at most 10 minutes,
# from the repo root on the device machine with the wheels of .whl carried (and LLAMACPP=.llamacpp, a copy of
# /work/shared/llamacpp-peer, for llama.cpp's side). Results go to $OUT/long-results.tgz after every step.
#   RUNS="kv32k" LLAMACPP=.llamacpp bash tools/gpu_long_context.sh   # decode @32K, q8_0 and int8 KV, llama-bench -ctk q8_0
#   RUNS="long128" bash tools/gpu_long_context.sh                    # prefill 8K and 128K, int8 KV, decode @128K
#   RUNS="long256" bash tools/gpu_long_context.sh                    # one 256K-token prompt, int8 KV, decode @256K
#                                                                    # (LONG_PROMPTS=1k: the decode alone)
#   RUNS="spec" bash tools/gpu_long_context.sh                       # n-gram speculation on the code-editing workload
#                                                                    # (make-synthetic --copy: a model that copies its prompt;
#                                                                    # SPEC_ARGS="--batch-invariant": greedy identity on CUDA too)
#   RUNS="mtp" bash tools/gpu_long_context.sh                        # MTP drafting: synthetic qwen3-next (8 layers, one
#                                                                    # nextn layer), --spec off vs mtp (MTP_ARGS: more flags;
#                                                                    # --batch-invariant covers no qwen3next layer on CUDA)
#   RUNS="sweep" bash tools/gpu_long_context.sh                      # the decode attention kernels at 32K by KV type
# The spec and mtp runs end with how many of the four texts are the same with drafts as without.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; RES=/tmp/long-results; mkdir -p "$OUT" "$RES"; T0=$(date +%s)
MODEL=/tmp/q30.gguf; LONG=/tmp/q30-256k.gguf; COPY=/tmp/q30-copy.gguf; NEXT=/tmp/next-mtp.gguf
step() { echo "[t=$(( $(date +%s) - T0 ))s] $*" | tee -a "$RES/steps.log"; tar -C /tmp -czf "$OUT/long-results.tgz" long-results; }
wanted() { [[ " ${RUNS:-kv32k} " == *" $1 "* ]]; }
same_texts() {  # how many requests of two bench-serve JSON reports streamed the same text
  python3 -c "import json, sys; a, b = (json.load(open(p))['per_request'] for p in sys.argv[1:]); \
print(f'{sum(x[\"text\"] == y[\"text\"] for x, y in zip(a, b))} of {len(a)} texts the same')" "$1" "$2"
}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH  # the carried ninja builds the CPU kernels
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$RES/pip.log" 2>&1 || { tail "$RES/pip.log"; exit 1; }
if wanted kv32k && [ -n "${LLAMACPP:-}" ]; then  # built beside the runs, in its own process session
  setsid bash -c "OUT=/tmp/llamacpp-out JOBS=10 BUILD_BUDGET=0 nice -n 19 bash '$LLAMACPP/llamacpp.sh' env build \
    && nice -n 19 cmake --build /tmp/llama.cpp/build-cuda -j 10 --target llama-bench; echo \"llama.cpp built rc=\$?\"" \
    > "$RES/llama-build.log" 2>&1 < /dev/null & build=$!
fi
if wanted kv32k; then
  [ -f $MODEL ] || strata make-synthetic --preset qwen3-30b-a3b --expert-type Q4_K $MODEL > "$RES/synth.log" 2>&1
  step "model ready"
fi
if wanted kv32k; then
  for kv in q8_0 int8; do
    timeout 150 strata bench --model $MODEL --devices cuda:0 --arena pinned --expert-cache 6144 --kv-type $kv \
      --max-context 33792 --prompts 8k --contexts 32k --decode-tokens 64 --repeats 2 > "$RES/bench-kv-$kv.log" 2>&1
    step "bench kv $kv rc=$?"; grep -E "^\| (prefill|decode)" "$RES/bench-kv-$kv.log"
  done
  if [ -n "${build:-}" ]; then
    wait $build; tail -1 "$RES/llama-build.log"
    timeout 240 /tmp/llama.cpp/build-cuda/bin/llama-bench -m $MODEL -ngl 99 -fa 1 -ub 2048 -ctk q8_0 -ctv q8_0 \
      -p 8192 -n 64 -d 32768 > "$RES/llama-bench-q8_0.log" 2>&1
    step "llama-bench q8_0 rc=$?"; grep -E "^\|" "$RES/llama-bench-q8_0.log"
  fi
fi
if wanted long128 || wanted long256; then
  [ -f $LONG ] || strata make-synthetic --preset qwen3-30b-a3b --expert-type Q4_K --context 262144 $LONG \
    > "$RES/synth-long.log" 2>&1
  step "long model ready"
fi
if wanted long128; then
  timeout 420 strata bench --model $LONG --devices cuda:0 --arena pinned --expert-cache 6144 --kv-type int8 \
    --max-context 135168 --prompts 8k,128k --contexts 128k --decode-tokens 16 --repeats 1 > "$RES/bench-128k.log" 2>&1
  step "bench 128k rc=$?"; grep -E "^\| (prefill|decode)" "$RES/bench-128k.log"
fi
if wanted long256; then
  timeout 480 strata bench --model $LONG --devices cuda:0 --arena pinned --expert-cache 6144 --kv-type int8 \
    --max-context 262144 --prompts ${LONG_PROMPTS:-256k} --contexts 256k --decode-tokens 16 --repeats 1 > "$RES/bench-256k.log" 2>&1
  step "bench 256k rc=$?"; grep -E "^\| (prefill|decode)" "$RES/bench-256k.log"
fi
if wanted spec; then  # one client, greedy, the committed prompts, on a model that copies its prompt (a random one doesn't)
  [ -f $COPY ] || strata make-synthetic --preset qwen3-30b-a3b --expert-type Q4_K --copy $COPY > "$RES/synth-copy.log" 2>&1
  step "copy model ready"
  for mode in off ngram; do
    timeout 200 strata bench serve --model $COPY --devices cuda:0 --arena pinned --expert-cache 6144 \
      --max-context 2048 --parallel 4 --spec $mode --spec-tokens 4 --clients 1 --requests 4 ${SPEC_ARGS:-} \
      --input tools/data/code_edit.jsonl --ignore-eos --no-progress --json "$RES/spec-$mode.json" > "$RES/spec-$mode.log" 2>&1
    step "spec $mode rc=$?"; grep -E "^\|" "$RES/spec-$mode.log" | head -12
  done
  same_texts "$RES/spec-off.json" "$RES/spec-ngram.json" | tee -a "$RES/steps.log"
fi
if wanted mtp; then  # drafting by the file's nextn layer; random weights accept few drafts, the texts must match
  [ -f $NEXT ] || strata make-synthetic --preset qwen3-next-80b-a3b --layers 8 --mtp-layers 1 --expert-type Q4_K $NEXT \
    > "$RES/synth-next.log" 2>&1
  step "mtp model ready"
  for mode in off mtp; do
    timeout 300 strata bench serve --model $NEXT --devices cuda:0 --arena pinned --max-context 2048 --parallel 4 \
      --spec $mode --spec-tokens 2 --clients 1 --requests 4 ${MTP_ARGS:-} --input tools/data/code_edit.jsonl \
      --ignore-eos --no-progress --json "$RES/mtp-$mode.json" > "$RES/mtp-$mode.log" 2>&1
    step "mtp $mode rc=$?"; grep -E "^\|" "$RES/mtp-$mode.log" | head -12
  done
  cp /tmp/strata-serve-*.log "$RES/" 2>/dev/null  # the servers' own logs (bench serve names them)
  same_texts "$RES/mtp-off.json" "$RES/mtp-mtp.json" | tee -a "$RES/steps.log"
fi
if wanted sweep; then
  timeout 300 python3 tools/attention_sweep.py --contexts 32768 --sessions 1,8 --kv-types q8_0,int8,fp8,bf16 \
    --json "$RES/attention.json" > "$RES/attention.log" 2>&1
  step "attention sweep rc=$?"; grep -E "context" "$RES/attention.log"
fi
step "done"
