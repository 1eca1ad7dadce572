#!/usr/bin/env bash
# strata::q8_linear on the H200 (issue 7): its CUDA tests and the fused-decode tests it touches, the
# GEMV bench against cuBLAS bf16 (tools/gemv_bench.py, < 60 s), then `strata bench` decode on the
# 30B-shaped model with the Q8_0 copies (default) and without (strata_core.model.fused_decode.DENSE_Q8
# off), 1 and 4 sessions, all experts resident, graphs on: the tok/s the switch is worth. ~5 min.
# From the repo root on the device machine, .whl carried:   bash tools/gpu_q8.sh
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; MODEL=/tmp/q30.gguf
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
[ -f $MODEL ] || (strata make-synthetic --preset qwen3-30b-a3b --expert-type Q4_K $MODEL > "$OUT/synth.log" 2>&1 &)
timeout 240 python3 -m pytest -q -n 8 tests/test_dense_q8.py tests/test_fused_decode.py tests/test_cuda_graphs.py \
  tests/test_decode_sync_cuda.py 2>&1 | tee "$OUT/tests.log" | grep -E "passed|failed|^FAILED|^ERROR" | tail -15
timeout 90 python3 tools/gemv_bench.py 2>&1 | tee "$OUT/gemv_bench.log" | grep -E "^best|skipped|wrote|BAD|Error"
while pgrep -f make-synthetic > /dev/null; do sleep 1; done
ARGS="--model $MODEL --devices cuda:0 --prompts 512 --contexts 1k --sessions 1,4 --repeats 2 --decode-tokens 128
  --arena pinned --max-context 2048 --expert-cache 6144 --cuda-graphs"
for q8 in True False; do
  echo "DENSE_Q8=$q8" | tee -a "$OUT/bench.log"
  timeout 150 python3 -c "import sys; import strata_core.model.fused_decode as f; f.DENSE_Q8 = $q8
from strata_core.cli import main; sys.argv[0] = 'strata'; sys.exit(main())" bench $ARGS \
    --json "$OUT/bench-q8-$q8.json" 2>&1 | tee -a "$OUT/bench.log" | grep -E "^\||^settings|Q8_0 copies"
done
