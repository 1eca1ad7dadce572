#!/usr/bin/env bash
# The whole test suite on the GPU machine in one call, its failures listed by name (pytest -rfE). From the
# repo root there, with the wheels of .whl carried (`bash tools/device_wheels.sh` fetches them here):
#   bash tools/gpu_suite.sh                 # $OUT/suite.log; WORKERS=8, SUITE_TIMEOUT=530 by default
#   PYTEST_ARGS="-k cuda tests plugins" bash tools/gpu_suite.sh   # a part of it
# With MODEL=PATH it also writes the synthetic Qwen3-30B-A3B there in the background, for a bench after it.
# Each worker's torch gets two CPU threads (WORKERS x torch's default of every core oversubscribes the host).
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH  # the carried ninja builds the CPU kernels
packages=$(for p in plugins/*/ examples/*/; do [ -f "$p/pyproject.toml" ] && printf -- '-e %s ' "$p"; done)
# shellcheck disable=SC2086
python3 -m pip install -q --no-deps --no-build-isolation -e . $packages > "$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
# a carried wheel older than the project asks (pip download picks by platform tag) fails here, not as test failures
python3 - <<'CHECK' || exit 1
import sys
from importlib.metadata import PackageNotFoundError, requires, version
from packaging.requirements import Requirement
bad = []
for req in map(Requirement, requires("strata")):
    if req.marker is None and req.name != "torch":  # torch: the image's own CUDA build
        try:
            found = version(req.name)
        except PackageNotFoundError:
            found = None
        if found is None or not req.specifier.contains(found, prereleases=True):
            bad.append(f"{req.name} {found or 'missing'} (the project asks {req.specifier})")
if bad:
    sys.exit("gpu_suite.sh: carry newer wheels in .whl: " + "; ".join(bad))
CHECK
if [ -n "${MODEL:-}" ] && [ ! -f "$MODEL" ]; then
  (strata make-synthetic --preset qwen3-30b-a3b --expert-type Q4_K "$MODEL.tmp" > "$OUT/synth.log" 2>&1 \
   && mv "$MODEL.tmp" "$MODEL") &
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# shellcheck disable=SC2086
timeout "${SUITE_TIMEOUT:-530}" python3 -m pytest -vv -rfE --timeout "${TEST_TIMEOUT:-120}" -n "${WORKERS:-8}" -p no:benchmark ${PYTEST_ARGS:-} > "$OUT/suite.log" 2>&1
status=$?
# by name, also after a timeout (the per-test lines of -vv: the addopts' -q cancels one -v)
grep -oE "(FAILED|ERROR) [A-Za-z0-9_/.-]+\.py::[^ ]+" "$OUT/suite.log" | sort -u | head -60
tail -3 "$OUT/suite.log"
[ -n "${MODEL:-}" ] && wait
exit "$status"
