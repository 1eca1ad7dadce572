#!/usr/bin/env bash
# Same-run `strata bench` of this tree against an older one, on the synthetic Qwen3-30B-A3B (Q4_K experts,
# every expert resident): 8K prefill and decode @1K, the two trees alternated ROUNDS times. BEFORE is a copy
# of the older strata_core's parent folder (`git archive REV strata_core | tar -x -C .before`, git-ignored,
# carried). Run after tools/gpu_suite.sh (which installs the project and, with MODEL set, writes the model):
#   BEFORE=.before MODEL=/tmp/q30.gguf bash tools/gpu_bench_compare.sh      # $OUT/before-N.log, $OUT/after-N.log
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
OUT=${OUT:-/tmp/out}; MODEL=${MODEL:-/tmp/q30.gguf}; BEFORE=$(realpath "${BEFORE:?a copy of the older tree}")
[ -f "$MODEL" ] || strata make-synthetic --preset qwen3-30b-a3b --expert-type Q4_K "$MODEL" > "$OUT/synth.log" 2>&1
args=(bench --model "$MODEL" --devices cuda:0 --arena pinned --expert-cache 6144 --prompts 8k --contexts 1k
      --decode-tokens 128 --sessions 1 --repeats "${REPEATS:-3}" --max-context 8500)
for round in $(seq "${ROUNDS:-2}"); do
  PYTHONPATH="$BEFORE:/tmp/site" timeout 200 python3 -m strata_core "${args[@]}" > "$OUT/before-$round.log" 2>&1
  timeout 200 python3 -m strata_core "${args[@]}" > "$OUT/after-$round.log" 2>&1
done
for f in "$OUT"/before-*.log "$OUT"/after-*.log; do echo "== $f"; grep -E "^\|" "$f"; done
