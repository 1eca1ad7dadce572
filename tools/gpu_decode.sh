#!/usr/bin/env bash
# Issue 7's table from one run on the GPU machine: the decode/kernel CUDA tests, `strata bench` with every
# expert on the GPU, half and none (the BENCHMARKS.md commands), the decode profile with replayed graphs,
# and llama.cpp (a copy of /work/shared/llamacpp-peer inside the checkout, git-ignored, carried) built in
# the background and benched on the same model: on a two-GPU machine its `gpu` placement runs on GPU 1
# beside Strata's benches, its host-RAM placements alone afterwards. From the repo root, .whl carried:
#   LLAMACPP=.llamacpp bash tools/gpu_decode.sh        # ~8 min on nvidia-h200-x2 (BENCHMARKS.md, issue 7)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; MODEL=/tmp/q30.gguf; LLAMA_OUT=/tmp/llamacpp-out; T0=$(date +%s)
export THREADS=${THREADS:-$(nproc --all)} OMP_NUM_THREADS=12  # llama.cpp's CPU experts get every core
step() { echo "[t=$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/steps.log"; }
left() { echo $(( ${DEADLINE:-585} - ($(date +%s) - T0) )); }
lim() { local l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
LGPU=0; [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && LGPU=1
llama() {  # llama() SECONDS PLACEMENT [UBATCH]: one llama-bench placement into $LLAMA_OUT
  OUT=$LLAMA_OUT UBATCH=${3:-2048} CUDA_VISIBLE_DEVICES=$LGPU timeout "$(lim "$1")" bash "$LLAMACPP/llamacpp.sh" \
    bench $MODEL "$2" > "$OUT/llamacpp-$2.log" 2>&1; step "llama.cpp $2 rc=$?"
}
if [ -n "${LLAMACPP:-}" ]; then
  (OUT=$LLAMA_OUT nice -n 10 bash "$LLAMACPP/llamacpp.sh" env build > "$OUT/llamacpp-build.log" 2>&1
   step "llama.cpp built rc=$?"
   if [ $LGPU = 1 ]; then
     while [ ! -f $MODEL ] || pgrep -f make-synthetic > /dev/null; do sleep 2; done
     llama 100 gpu
   fi) &
  BUILD=$!
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
[ -f $MODEL ] || (strata make-synthetic --preset qwen3-30b-a3b --expert-type Q4_K $MODEL > "$OUT/synth.log" 2>&1 &)
timeout "$(lim 150)" python3 -m pytest -q -n 4 tests/test_decode_ops_cuda.py tests/test_kernels_cuda.py \
  tests/test_cuda_graphs.py tests/test_decode_sync_cuda.py tests/test_fused_decode.py tests/test_moe_served.py \
  tests/test_dense_q8.py > "$OUT/tests.log" 2>&1; step "tests rc=$?"
while [ ! -f $MODEL ] || pgrep -f make-synthetic > /dev/null; do sleep 1; done
B="strata bench --model $MODEL --devices cuda:0 --arena pinned --cuda-graphs --repeats 2"
timeout "$(lim 110)" $B --expert-cache 6144 --prompts 8k,32k --contexts 1k,32k --decode-tokens 128 --sessions 1,4 \
  --sampled --max-context 33000 > "$OUT/bench-all.log" 2>&1; step "bench all resident rc=$?"
timeout "$(lim 60)" $B --expert-cache 3072 --prompts 8k --contexts 1k --decode-tokens 64 --max-context 8500 \
  > "$OUT/bench-half.log" 2>&1; step "bench half resident rc=$?"
timeout "$(lim 60)" $B --expert-cache 0 --prompts 8k --contexts 1k --decode-tokens 16 --max-context 8500 \
  > "$OUT/bench-host.log" 2>&1; step "bench all in host RAM rc=$?"
timeout "$(lim 50)" python3 tools/profile_decode.py $MODEL --context 1024 --windows 32 --cuda-graphs --top 24 \
  > "$OUT/profile.log" 2>&1; step "profile rc=$?"
if [ -n "${LLAMACPP:-}" ]; then
  wait "$BUILD"
  [ $LGPU = 0 ] && llama 90 gpu
  llama 80 cmoe24-pin
  llama 80 cmoe48-pin 8192
  cp $LLAMA_OUT/bench.md "$OUT/llamacpp-bench.md" 2> /dev/null
fi
grep -E "passed|failed" "$OUT/tests.log" | tail -2
for f in "$OUT"/bench-*.log; do echo "== $f"; grep -E "^\||^settings" "$f"; done
grep -E "unprofiled|wall|^ +[0-9.]+ ms" "$OUT/profile.log" | head -16
cat "$OUT/llamacpp-bench.md" 2> /dev/null | head -12
