#!/usr/bin/env bash
# The consumer-budget row (BENCHMARKS.md): a synthetic model far bigger than the budget, `strata bench` with
# everything it places on the GPU within --vram-budget-gib, then llama.cpp on the same file with the
# --n-cpu-moe that `strata bench` names for the same budget (its llama-bench lines), both with every host core.
# From the repo root on the device machine, .whl and LLAMACPP (a copy of /work/shared/llamacpp-peer) carried:
#   LLAMACPP=.llamacpp bash tools/gpu_budget.sh                                  # qwen3-next-80b-a3b at 24 GiB
#   PRESET=gpt-oss-120b LAYERS=24 BUDGET=24 LLAMACPP=.llamacpp bash tools/gpu_budget.sh
# The 80B file is ~45 GB (the device disk holds one such file); results in $OUT/budget.tgz after every step.
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; R=/tmp/budget; mkdir -p "$OUT" $R; T0=$(date +%s)
PRESET=${PRESET:-qwen3-next-80b-a3b}; BUDGET=${BUDGET:-24}; M=/tmp/$PRESET${LAYERS:+-$LAYERS}.gguf
step() { echo "[t=$(( $(date +%s) - T0 ))s] $*" | tee -a $R/steps.log; tar -C /tmp -czf "$OUT/budget.tgz" budget; }
left() { echo $(( ${DEADLINE:-585} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
python3 -m pip install -q --no-deps --no-build-isolation -e . > $R/pip.log 2>&1 || { tail $R/pip.log; exit 1; }
if [ -n "${LLAMACPP:-}" ] && [ ! -x /tmp/llama.cpp/build-cuda/bin/llama-bench ]; then  # built beside the model's writing
  setsid bash -c "OUT=/tmp/llamacpp-out JOBS=12 BUILD_BUDGET=0 nice -n 19 bash '$LLAMACPP/llamacpp.sh' env build; echo built rc=\$?" \
    > $R/llama-build.log 2>&1 < /dev/null &
fi
[ -f $M ] || strata make-synthetic --preset $PRESET ${LAYERS:+--layers $LAYERS} $M > $R/synth.log 2>&1
step "model rc=$? $(du -h $M | cut -f1)"
timeout $(( $(left) - 200 )) strata bench --model $M --devices cuda:0 --arena pinned --vram-budget-gib $BUDGET \
  --prompts 8k --contexts 1k --decode-tokens 32 --repeats 2 > $R/strata.log 2>&1
step "strata bench rc=$?"; grep -E "^\| (prefill|decode)|llama|arena|cache" $R/strata.log | head -20
[ -n "${LLAMACPP:-}" ] || { step done; exit 0; }
while ! grep -q "built rc" $R/llama-build.log 2> /dev/null && [ "$(left)" -gt 150 ]; do sleep 2; done
grep -E "^llama-bench" $R/strata.log | sed "s#^llama-bench#/tmp/llama.cpp/build-cuda/bin/llama-bench -r 2#" > $R/llama-cmds.sh
while read -r cmd; do
  l=$(left); [ "$l" -lt 20 ] && break
  timeout $(( l - 10 )) bash -c "$cmd" >> $R/llama-bench.log 2>&1; step "llama-bench rc=$?"
done < $R/llama-cmds.sh
grep -E "^\|" $R/llama-bench.log
step done
