#!/usr/bin/env bash
# The serving table of BENCHMARKS.md in device calls: `strata bench serve` (1K-token prompts, 128 output
# tokens) against `strata serve` of this tree, started once per server configuration and driven by
# several client counts over --url; the same against an older tree's server (BEFORE: a copy of its
# strata_core's parent folder, `git archive REV strata_core | tar -x -C .before`, git-ignored, carried);
# `strata bench` decode at several sessions; llama.cpp's llama-batched-bench on the same file (LLAMACPP:
# a copy of /work/shared/llamacpp-peer, git-ignored, carried; built niced in its own process session meanwhile,
# which outlives the call; STAGE=2 in a later call within the machine's idle window waits for it, then runs it). Results go to $OUT/serve-results.tgz
# after every step (a call past its limit still returns them): do not pipe the output through `tail`.
#   RUNS="full half longprompt spec" bash tools/gpu_serve_bench.sh   # this tree's servers (after gpu_suite.sh)
#   RUNS="before-half sessions" BEFORE=.before bash tools/gpu_serve_bench.sh
#   STAGE=2 LLAMACPP=.llamacpp bash tools/gpu_serve_bench.sh     # llama-batched-bench
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; MODEL=${MODEL:-/tmp/q30.gguf}; DEVICES=${DEVICES:-cuda:0}; RES=/tmp/serve-results; mkdir -p "$OUT" "$RES"; T0=$(date +%s)
# after each step the results so far go to $OUT (one tarball: a call past its limit still returns them)
step() { echo "[t=$(( $(date +%s) - T0 ))s] $*" | tee -a "$RES/steps.log"; tar -C /tmp -czf "$OUT/serve-results.tgz" serve-results; }
wanted() { [[ " ${RUNS:-full half longprompt spec before-half sessions} " == *" $1 "* ]]; }
# server TREE NAME "CLIENTS..." [serve flags...]: one `strata serve` (every expert resident unless the flags
# say), then one `bench serve --url` per client count into $RES/NAME-cCLIENTS.{log,json}, then the server goes.
# Each count sends prompts of its own seed: a later run must not find an earlier one's prompts cached.
start_server() {  # start_server TREE NAME [serve flags...]: sets PORT and PID once /health answers
  local tree=$1 name=$2; shift 2
  local path=/tmp/site t=0
  PORT=$((8100 + RANDOM % 500))
  [ "$tree" = before ] && path="$(realpath "$BEFORE"):/tmp/site"
  PYTHONPATH=$path PYTHONFAULTHANDLER=1 python3 -m strata_core serve --model $MODEL --devices $DEVICES --arena pinned \
    --expert-cache 6144 --max-context 2048 --port $PORT "$@" > "$RES/$name-server.log" 2>&1 &
  PID=$!
  until python3 -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:$PORT/health').status_code != 200)" 2> /dev/null; do
    sleep 1; t=$((t + 1))
    if ! kill -0 $PID 2> /dev/null || [ $t -gt 200 ]; then
      step "$name: server not ready after ${t}s"; tail -3 "$RES/$name-server.log"
      kill -ABRT $PID 2> /dev/null; sleep 2; kill -9 $PID 2> /dev/null; return 1
    fi
  done
  step "$name: server ready after ${t}s"
}
clients() {  # clients NAME N [extra flags]: one `bench serve --url` of N clients against the running server
  local name=$1 c=$2; shift 2
  timeout 150 strata bench serve --url "http://127.0.0.1:$PORT" --clients "$c" --requests $((c * 3)) \
    --prompt-tokens 1024 --output-tokens 128 --prompt-seed "$c" --no-progress --json "$RES/$name.json" "$@" \
    > "$RES/$name.log" 2>&1
  step "$name rc=$?"; grep -E "^\|" "$RES/$name.log" | head -16
}
# server TREE NAME "CLIENTS..." [serve flags...]: one `strata serve` (every expert resident unless the flags
# say), then one `bench serve --url` per client count into $RES/NAME-cCLIENTS.{log,json}, then the server goes.
# Each count sends prompts of its own seed: a later run must not find an earlier one's prompts cached.
server() {
  local tree=$1 name=$2 counts=$3 eos=--ignore-eos; shift 3
  wanted "$name" || return 0
  [ "$tree" = before ] && eos=""  # its server has no ignore_eos (a random model's greedy text rarely ends)
  start_server "$tree" "$name" "$@" || return 1
  for c in $counts; do clients "$name-c$c" "$c" $eos; done
  kill $PID; wait $PID 2> /dev/null
}
# longprompt: eight streams alone, then again with one 32K-token prompt sent 2 s into the run; the
# issue's bound is the second run's ITL p99 against the first's p50
longprompt() {
  wanted longprompt || return 0
  start_server after longprompt --parallel 9 --max-context 33792 --kv-pool-tokens 200000 || return 1
  clients longprompt-alone 8 --ignore-eos
  (sleep 2; python3 -c "import httpx, random; ids = [random.randrange(1000, 100000) for _ in range(32768)]
url = 'http://127.0.0.1:$PORT/v1'; model = httpx.get(url + '/models').json()['data'][0]['id']
r = httpx.post(url + '/completions', json={'model': model, 'prompt': ids, 'max_tokens': 1}, timeout=300)
print('32K prompt:', r.status_code, r.json().get('timings', r.text[:200]))" > "$RES/longprompt-32k.log" 2>&1) &
  clients longprompt-with-32k 8 --ignore-eos --prompt-seed 108  # prompts of their own: none cached by the first run
  wait; cat "$RES/longprompt-32k.log"
  kill $PID; wait $PID 2> /dev/null
}
if [ "${STAGE:-1}" = 1 ]; then
  if [ -n "${LLAMACPP:-}" ]; then  # in its own session (setsid): a call's other processes die when it returns
    setsid bash -c "OUT=/tmp/llamacpp-out JOBS=10 BUILD_BUDGET=0 nice -n 19 bash '$LLAMACPP/llamacpp.sh' env build \
      && nice -n 19 cmake --build /tmp/llama.cpp/build-cuda -j 10 --target llama-batched-bench; echo \"llama.cpp built rc=\$?\"" \
      > "$RES/llama-build.log" 2>&1 < /dev/null & echo $! > /tmp/llama-build.pid
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH  # the carried ninja builds the CPU kernels
  python3 -m pip install -q --no-deps --no-build-isolation -e . > "$RES/pip.log" 2>&1 || { tail "$RES/pip.log"; exit 1; }
  [ -f $MODEL ] || strata make-synthetic --preset qwen3-30b-a3b --expert-type Q4_K $MODEL > "$RES/synth.log" 2>&1
  step "model ready"
  server after full "1 8 32" --parallel 32
  server after step512 "8" --parallel 8 --step-tokens 512
  server after half "8" --parallel 8 --expert-cache 3072
  longprompt
  if wanted spec; then  # n-gram speculation on the committed code-editing workload, one client, greedy
    for mode in off ngram; do
      start_server after "spec-$mode" --parallel 4 --spec "$mode" || continue
      timeout 240 strata bench serve --url "http://127.0.0.1:$PORT" --clients 1 --requests 4 \
        --input tools/data/code_edit.jsonl --ignore-eos --no-progress --json "$RES/spec-$mode.json" \
        > "$RES/spec-$mode.log" 2>&1
      step "spec-$mode rc=$?"; grep -E "^\|" "$RES/spec-$mode.log" | head -16
      kill $PID; wait $PID 2> /dev/null
    done
  fi
  server before before-half "8" --parallel 8 --expert-cache 3072
  if wanted sessions; then
    timeout 150 strata bench --model $MODEL --devices cuda:0 --arena pinned --expert-cache 6144 --prompts 1k \
      --contexts 1k --decode-tokens 64 --sessions 1,8 --sampled --repeats 2 --max-context 1200 \
      > "$RES/bench-sessions.log" 2>&1; step "bench sessions rc=$?"; grep -E "^\|" "$RES/bench-sessions.log"
  fi
else
  while [ -f /tmp/llama-build.pid ] && kill -0 "$(cat /tmp/llama-build.pid)" 2> /dev/null; do sleep 2; done  # the build STAGE 1 started
  tail -2 "$RES/llama-build.log"
  BB=/tmp/llama.cpp/build-cuda/bin/llama-batched-bench
  [ -x $BB ] && timeout 300 $BB -m $MODEL -ngl 99 -fa 1 -c 40960 -b 2048 -ub 512 -npp 1024 -ntg 128 -npl 1,8,32 \
    > "$RES/llama-batched.log" 2>&1; step "llama-batched-bench rc=$?"; grep -E "^\|" "$RES/llama-batched.log"
fi
step "done"
