#!/usr/bin/env bash
# The serving table of BENCHMARKS.md in one device session: `strata bench serve` (1K-token prompts, 128
# output tokens, every expert resident unless said) of this tree and of an older one (BEFORE: a copy of its
# strata_core's parent folder, `git archive REV strata_core | tar -x -C .before`, git-ignored, carried),
# `strata bench` decode at several sessions, and llama.cpp's llama-batched-bench on the same file (LLAMACPP:
# a copy of /work/shared/llamacpp-peer, git-ignored, carried; built niced in the background meanwhile).
# Two calls, the second within the machine's idle window (the build outlives one call's 600 s); about
# 7 minutes of device time for stage 1 (each server start pins the 16 GiB of experts). Do not pipe the
# call's output through `tail`: what a call past its limit printed is lost, the tarball is not.
#   STAGE=1 BEFORE=.before LLAMACPP=.llamacpp bash tools/gpu_serve_bench.sh   # install, build start, Strata runs
#   STAGE=2 LLAMACPP=.llamacpp bash tools/gpu_serve_bench.sh                  # llama-batched-bench, the summary
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; MODEL=/tmp/q30.gguf; RES=/tmp/serve-results; mkdir -p "$OUT" "$RES"; T0=$(date +%s)
# after each step the results so far go to $OUT (one tarball: a call past its limit still returns them)
step() { echo "[t=$(( $(date +%s) - T0 ))s] $*" | tee -a "$RES/steps.log"; tar -C /tmp -czf "$OUT/serve-results.tgz" serve-results; }
serve() {  # serve TREE NAME CLIENTS PARALLEL [flags...]: one `strata bench serve` run into $RES/NAME.{log,json}
  local tree=$1 name=$2 clients=$3 parallel=$4; shift 4
  [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $name "* ]] || return 0  # ONLY="after-c8 ...": those runs alone
  local path=/tmp/site; [ "$tree" = before ] && path="$(realpath "$BEFORE"):/tmp/site"
  PYTHONPATH=$path PYTHONFAULTHANDLER=1 timeout "${SERVE_LIMIT:-240}" python3 -m strata_core bench serve --model $MODEL --devices cuda:0 --arena pinned \
    --expert-cache 6144 --max-context 2048 --parallel "$parallel" --clients "$clients" --requests $((clients * 3)) \
    --prompt-tokens 1024 --output-tokens 128 --ignore-eos --no-progress --json "$RES/$name.json" "$@" \
    > "$RES/$name.log" 2>&1
  local rc=$?
  # a server left behind by a run past its limit prints where it was (faulthandler) and goes
  pkill -ABRT -f "strata_core serve" && sleep 2; pkill -9 -f "strata_core serve"
  for f in /tmp/strata-serve-*.log; do [ -f "$f" ] && mv "$f" "$RES/$name-server.log"; done
  step "$name rc=$rc"; grep -E "^\|" "$RES/$name.log" | head -12; [ $rc = 0 ] || tail -5 "$RES/$name-server.log"
}
if [ "${STAGE:-1}" = 1 ]; then
  if [ -n "${LLAMACPP:-}" ]; then
    (OUT=/tmp/llamacpp-out JOBS=10 BUILD_BUDGET=0 nice -n 19 bash "$LLAMACPP/llamacpp.sh" env build > "$RES/llama-build.log" 2>&1 \
     && nice -n 19 cmake --build /tmp/llama.cpp/build-cuda -j 10 --target llama-batched-bench >> "$RES/llama-build.log" 2>&1
     step "llama.cpp built rc=$?") &
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
  python3 -m pip install -q --no-deps --no-build-isolation -e . > "$RES/pip.log" 2>&1 || { tail "$RES/pip.log"; exit 1; }
  [ -f $MODEL ] || strata make-synthetic --preset qwen3-30b-a3b --expert-type Q4_K $MODEL > "$RES/synth.log" 2>&1
  step "model ready"
  serve after after-c8 8 8
  serve after after-c1 1 8
  [ -n "${BEFORE:-}" ] && serve before before-c8 8 8
  serve after after-c32 32 32
  serve after after-c8-half 8 8 --expert-cache 3072
  [ -n "${BEFORE:-}" ] && serve before before-c8-half 8 8 --expert-cache 3072
  [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" bench-sessions "* ]] && timeout 150 strata bench --model $MODEL --devices cuda:0 --arena pinned --expert-cache 6144 --prompts 1k \
    --contexts 1k --decode-tokens 64 --sessions 1,4,16,64 --sampled --repeats 2 --max-context 1200 \
    > "$RES/bench-sessions.log" 2>&1; step "bench sessions rc=$?"; grep -E "^\|" "$RES/bench-sessions.log"
else
  while pgrep -f "llamacpp.sh|cmake --build" > /dev/null; do sleep 2; done
  tail -2 "$RES/llama-build.log"
  BB=/tmp/llama.cpp/build-cuda/bin/llama-batched-bench
  [ -x $BB ] && timeout 300 $BB -m $MODEL -ngl 99 -fa 1 -c 40960 -b 2048 -ub 512 -npp 1024 -ntg 128 -npl 1,8,32 \
    > "$RES/llama-batched.log" 2>&1; step "llama-batched-bench rc=$?"; grep -E "^\|" "$RES/llama-batched.log"
fi
step "done"
