export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . > $OUT/pip.log 2>&1 || { tail $OUT/pip.log; exit 1; }
[ -f /tmp/q30.gguf ] || strata make-synthetic --preset qwen3-30b-a3b --expert-type Q4_K /tmp/q30.gguf > $OUT/synth.log 2>&1
timeout 250 python3 tools/profile_decode.py /tmp/q30.gguf --context 1024 --windows 16 --sessions 1,8,32 --cuda-graphs --top 12 > $OUT/prof.log 2>&1
echo prof rc=$?
cat $OUT/prof.log | grep -v Warning | tail -80
