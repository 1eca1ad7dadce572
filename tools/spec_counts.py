"""N-gram speculation's tokens a window on the committed code-editing workload (tools/data/code_edit.jsonl):
counts, not time, through the scheduler, for --spec-tokens off, 4 and 8; the text must be the same.

    python tools/spec_counts.py [MODEL.gguf] [--devices cpu]   # default: the embedded demo model

A model that repeats its prompt keeps most drafts: ``strata make-synthetic --preset small --copy small-copy.gguf``
(or ``--preset qwen3-30b-a3b --layers 2 --copy``: the copy circuit's layers at the 30B widths; the others add nothing).
"""

import asyncio
import json
import sys
from strata_core.engine import Engine
from strata_core.serving.requests import Delta, GenerationRequest
from strata_core.serving.sampling import SamplingParams
from strata_core.serving.scheduler import Scheduler

args = sys.argv[1:]
device = args[args.index("--devices") + 1] if "--devices" in args else "cpu"
model = next((a for a in args if a.endswith(".gguf")), "strata_core/data/demo-qwen3moe-q8_0.gguf")
engine = Engine.load(model, devices=[device], max_context=1024)
seen = set()
prompts = [json.loads(line)["prompt"] for line in open("tools/data/code_edit.jsonl")]
for k in (0, 4, 8):
    scheduler = Scheduler(engine, parallel=1, max_queue=8, conv_cache=0, conv_cache_bytes=0, step_tokens=1024,
                          spec_tokens=k)

    async def main():
        out = []
        for p in prompts:
            h = scheduler.submit(GenerationRequest(engine.tokenizer.encode(p), SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)))
            out.append("".join([e.text async for e in h if isinstance(e, Delta)]))
        return out

    scheduler.start()
    try:
        texts = asyncio.run(main())
    finally:
        scheduler.stop()
    st = scheduler.stats
    print(f"spec_tokens={k}: {st.completion_tokens} tokens in {st.windows} windows "
          f"({(st.completion_tokens - st.requests) / st.windows:.2f} a window), drafts kept {st.accepted_tokens}/{st.draft_tokens}",
          flush=True)
    seen.add(tuple(texts))
print("the same text in every run" if len(seen) == 1 else "THE TEXT DIFFERS BETWEEN RUNS")
