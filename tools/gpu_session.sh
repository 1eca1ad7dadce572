#!/usr/bin/env bash
# A device session's measurements in three calls of one lease (each within a call's 600 s; the second and third
# within the machine's idle window after the one before). From the repo root there, .whl and .llamacpp carried
# (`bash tools/device_wheels.sh`; `cp -r /work/shared/llamacpp-peer .llamacpp`):
#   STAGE=1 bash tools/gpu_session.sh   # llama.cpp built in the background, the whole suite, serving at 1/8/32 clients
#   STAGE=2 bash tools/gpu_session.sh   # llama-batched-bench, decode by sessions, a profile of 1 and 8 sessions,
#                                       # a 32K prompt among 8 streams
#   STAGE=3 bash tools/gpu_session.sh   # the CPU share's threads (default and passive OpenMP wait), the --pcie-frac sweep
# Files under $OUT: suite.log, serve-results.tgz (gpu_serve_bench.sh's), sessions.log, profile.log, cpu-share.tgz.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; MODEL=${MODEL:-/tmp/q30.gguf}; mkdir -p "$OUT" /tmp/serve-results
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
case "${STAGE:-1}" in
1)
  setsid bash -c "OUT=/tmp/llamacpp-out JOBS=10 BUILD_BUDGET=0 nice -n 19 bash .llamacpp/llamacpp.sh env build \
    && nice -n 19 cmake --build /tmp/llama.cpp/build-cuda -j 10 --target llama-batched-bench; echo \"llama.cpp built rc=\$?\"" \
    > /tmp/serve-results/llama-build.log 2>&1 < /dev/null & echo $! > /tmp/llama-build.pid
  MODEL=$MODEL WORKERS=14 SUITE_TIMEOUT=${SUITE_TIMEOUT:-330} bash tools/gpu_suite.sh
  echo "suite rc=$?"
  RUNS="${RUNS:-full}" MODEL=$MODEL timeout "${SERVE_TIMEOUT:-220}" bash tools/gpu_serve_bench.sh
  ;;
2)
  STAGE=2 MODEL=$MODEL timeout 200 bash tools/gpu_serve_bench.sh
  timeout 120 strata bench --model "$MODEL" --devices cuda:0 --arena pinned --expert-cache 6144 --prompts 1k \
    --contexts 1k --decode-tokens 32 --sessions 1,4,8,16,64 --sampled --repeats 2 --max-context 1200 > "$OUT/sessions.log" 2>&1
  echo "sessions rc=$?"; grep -E "^\|" "$OUT/sessions.log"
  timeout 100 python3 tools/profile_decode.py "$MODEL" --sessions 1,8 --cuda-graphs --windows 8 > "$OUT/profile.log" 2>&1
  echo "profile rc=$?"; grep -vE "it/s|B/s|expert/s" "$OUT/profile.log" | head -60
  RUNS=longprompt MODEL=$MODEL timeout 150 bash tools/gpu_serve_bench.sh
  ;;
3)
  R=/tmp/cpu-share-threads; mkdir -p $R
  export PYTHONPATH=/tmp/site:$PWD
  { nproc; lscpu | grep -E "Model name|Thread|Core|Socket|NUMA|L3"; } > $R/host.log 2>&1
  timeout 150 python3 tools/cpu_share_bench.py --threads 1,2,4,8,12,16 --repeats 30 > $R/share.log 2>&1
  echo "share rc=$?"
  OMP_WAIT_POLICY=PASSIVE timeout 100 python3 tools/cpu_share_bench.py --threads 4,8,16 --repeats 30 \
    > $R/share-passive.log 2>&1; echo "passive rc=$?"
  tar -C /tmp -czf "$OUT/cpu-share-threads.tgz" cpu-share-threads
  cat $R/host.log; tail -30 $R/share.log; tail -15 $R/share-passive.log
  SKIP_TABLES=1 FRACS="auto 1 0.5 0" DEADLINE=300 bash tools/gpu_cpu_share.sh
  ;;
*) echo "STAGE is 1, 2 or 3" >&2; exit 2 ;;
esac
