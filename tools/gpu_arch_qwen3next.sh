#!/usr/bin/env bash
# Issue 11, qwen3next on one H200: `strata bench` on the qwen3-next-80b-a3b preset with 8 of its 48
# layers (6 Gated DeltaNet + 2 gated attention, 4096 Q4_K experts, 7.7 GiB, built in ~19 s), every
# expert resident, fla-core installed; then the Gated DeltaNet CUDA tests (flash-linear-attention's
# chunked kernel and the torch chunked form against the recurrent one; the engine against the CPU,
# decode eager and as CUDA graphs; a hand-off) and the two chunked forms timed at Qwen3-Next-80B's
# shapes. Budget ~5 minutes alone on the GPU: the first fla call compiles its Triton kernels (the
# 2026-11-30 run, three arch scripts sharing one GPU with 50/20/70 s limits, ended before any figure).
# Run from the repo root on the device machine with the wheels of .whl carried:
#   OUT=$OUT bash tools/gpu_arch_qwen3next.sh
set -x
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; MODEL=/tmp/q3n.gguf; FLA=/tmp/fla-site
if ! PYTHONPATH=/tmp/site python3 -c "import strata_core" 2> /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  PYTHONPATH=/tmp/site python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/layer_split \
    -e plugins/prefill_main > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
fi
# fla-core (pure Python + Triton) and einops in their own folder: on PYTHONPATH only for this script
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $FLA .whl/fla/*.whl \
  > "$OUT/q3n-fla-pip.log" 2>&1 || tail "$OUT/q3n-fla-pip.log"
export PYTHONPATH=/tmp/site:$FLA
[ -f $MODEL ] || (/usr/bin/time -f "make-synthetic %e s" strata make-synthetic --preset qwen3-next-80b-a3b \
  --layers 8 --expert-type Q4_K $MODEL > "$OUT/q3n-make.log" 2>&1 &)
while pgrep -f "make-synthetic --preset qwen3-next" > /dev/null; do sleep 1; done
tail -1 "$OUT/q3n-make.log"; strata info $MODEL 2>&1 | tee "$OUT/q3n-info.log" | sed -n 5,7p
timeout 150 strata bench --model $MODEL --devices cuda:0 --expert-cache 4096 --arena pinned --cuda-graphs \
  --prompts 4k --contexts 1k --decode-tokens 16 --repeats 1 --sessions 1,4 2>&1 \
  | tee "$OUT/q3n-bench.log" | grep -v "^INFO\|^WARNING" | tail -7
python3 -c "import torch, fla; print('torch', torch.__version__, 'fla-core', fla.__version__)" 2>&1 | tee "$OUT/q3n-versions.log"
timeout 180 python3 -m pytest -q tests/test_qwen3next_cuda.py 2>&1 \
  | tee "$OUT/q3n-tests.log" | tail -12
# one layer's chunked delta rule at Qwen3-Next-80B's shapes (16 key / 32 value heads of 128), bf16, 4k tokens
timeout 60 python3 - <<'EOF' 2>&1 | tee "$OUT/q3n-gdn-forms.log"
import torch
from strata_core.model.qwen3next.deltanet import delta_rule, l2_norm
T = 4096
q, k = (l2_norm(torch.randn(T, 16, 128, device="cuda"), 1e-6).bfloat16() for _ in range(2))
v = torch.randn(T, 32, 128, device="cuda").bfloat16()
g, beta = -0.3 * torch.rand(T, 32, device="cuda"), torch.rand(T, 32, device="cuda").bfloat16()
for form in ("fla", "torch"):
    state = torch.zeros(32, 128, 128, device="cuda")
    delta_rule(q, k, v, g, beta, state, 16, form)  # warm-up (Triton compile / autotune)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        delta_rule(q, k, v, g, beta, state, 16, form)
    end.record(); torch.cuda.synchronize()
    ms = start.elapsed_time(end) / 5
    print(f"delta rule {form:5s} T={T}: {ms:.2f} ms per layer ({T / ms * 1e3:,.0f} tok/s per layer)")
EOF
