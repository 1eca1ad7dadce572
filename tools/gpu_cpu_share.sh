#!/usr/bin/env bash
# The GPU hybrid's CPU share on the GPU machine (BENCHMARKS.md, "The GPU hybrid's CPU share"): the host's
# compiler, each kernel format's one-matrix rate per instruction set, the CPU share of a decode layer by
# threads (worker, main thread, the copies around it, libgomp's spin), then `strata bench` of the synthetic
# Qwen3-30B-A3B with every expert in pinned host RAM, every miss on the CPU against every miss over the
# link (4.1 and 41.1 tok/s on the H100 before this branch). From the repo root, .whl carried:
#   bash tools/gpu_cpu_share.sh        # ~7 min on nvidia-h100-x1; results in $OUT/cpu-share.tgz
#   SKIP_TABLES=1 FRACS="auto 1 0.75 0.5 0.25 0" bash tools/gpu_cpu_share.sh   # the --pcie-frac sweep alone
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; R=/tmp/cpu-share; MODEL=/tmp/q30.gguf; T0=$(date +%s); mkdir -p "$OUT" $R
# the logs in $R, tarred to $OUT/cpu-share.tgz after every step (a device call returns at most 8 files)
step() { echo "[t=$(( $(date +%s) - T0 ))s] $*" | tee -a "$R/steps.log"; tar -C /tmp -czf "$OUT/cpu-share.tgz" cpu-share; }
left() { echo $(( ${DEADLINE:-585} - ($(date +%s) - T0) )); }
lim() { local l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD CUDA_VISIBLE_DEVICES=0
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$R/pip.log" 2>&1 || { tail "$R/pip.log"; exit 1; }
[ -f $MODEL ] || (strata make-synthetic --preset qwen3-30b-a3b --expert-type Q4_K $MODEL > "$R/synth.log" 2>&1 &)
{ c++ --version | head -1; nproc; lscpu | grep -E "Model name|Thread|Core|Socket|NUMA node\(s\)"; } > "$R/host.log" 2>&1
if [ -z "${SKIP_TABLES:-}" ]; then
  timeout "$(lim 120)" python3 tools/cpu_kernel_isa_bench.py > "$R/isa.log" 2>&1; step "isa table rc=$?"
  timeout "$(lim 150)" python3 tools/cpu_share_bench.py --threads 1,4,8,15,16 --repeats 40 --json "$R/cpu_share.json" \
    > "$R/cpu_share.log" 2>&1; step "cpu share rc=$?"
fi
while [ ! -f $MODEL ] || pgrep -f make-synthetic > /dev/null; do sleep 1; done
B="strata bench --model $MODEL --devices cuda:0 --arena pinned --expert-cache 0 --prompts 32,512 --contexts 1k --decode-tokens 32 --repeats 2"
for frac in ${FRACS:-0 1}; do  # FRACS="auto 1 0.75 0.5 0.25 0": auto against every fixed split
  [ "$(left)" -lt 40 ] && break
  timeout "$(lim 150)" $B --pcie-frac "$frac" > "$R/bench-frac$frac.log" 2>&1; step "bench --pcie-frac $frac rc=$?"
done
