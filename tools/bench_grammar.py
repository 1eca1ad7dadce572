"""The grammar mask's cost per decode window: ``sample_rows`` for B rows with and without a JSON
schema on every row, on a GGUF's tokenizer (logits as wide as its vocabulary), with the device's
share split out (the bitmask applied to the logits); the rest is the host's (filling the bitmask,
copying it, advancing the matchers).

    python tools/bench_grammar.py [--model PATH.gguf] [--rows 8] [--windows 200] [--device cuda]

Random logits drive the rows; a row whose JSON is complete starts a new one, so every window
masks every row.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from strata_core.config import DEMO_MODEL
from strata_core.serving.grammar import Grammars, json_schema_grammar
from strata_core.serving.sampling import Sampler, SamplingParams, sample_rows
from strata_core.serving.token_mask import apply_bitmask, fill_bitmask
from strata_core.text.tokenizer import Tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 5},
                         "address": {"type": "object", "required": ["city", "zip"], "additionalProperties": False,
                                     "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                         "pattern": "[0-9]{5}"}}}}}


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _per_window(run: Callable[[], None], windows: int, device: str) -> float:
    """Milliseconds per call of ``run``, after a few warm-up calls."""
    for _ in range(5):
        run()
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(windows):
        run()
    _synchronize(device)
    return (time.perf_counter() - start) / windows * 1000.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEMO_MODEL), help="GGUF whose tokenizer is used")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--windows", type=int, default=200)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    tokenizer = Tokenizer.from_gguf(args.model)
    vocab = tokenizer.vocab_size
    start = time.perf_counter()
    grammars = Grammars(tokenizer, vocab)
    grammars.ll_tokenizer
    print(f"{args.model}: vocabulary {vocab}, llguidance tokenizer built in {time.perf_counter() - start:.2f} s; "
          f"{args.rows} rows on {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    grammar = json_schema_grammar(SCHEMA, "schema")
    logits = torch.randn(args.rows, vocab, generator=torch.Generator().manual_seed(0), device="cpu").to(args.device)
    params = SamplingParams(temperature=1.0, seed=0)
    free = [(Sampler(params), []) for _ in range(args.rows)]
    rows = [(Sampler(params, grammars.compile(grammar, "schema")), []) for _ in range(args.rows)]
    restarts = 0

    def constrained() -> None:
        nonlocal restarts
        for i, result in enumerate(sample_rows(logits, rows)):
            if isinstance(result, Exception) or result.complete or result.token in tokenizer.eos_token_ids:
                rows[i] = (Sampler(params, grammars.compile(grammar, "schema")), [])
                restarts += 1

    base = _per_window(lambda: sample_rows(logits, free), args.windows, args.device)
    masked = _per_window(constrained, args.windows, args.device)
    mask = fill_bitmask([s.constraint for s, _ in rows], vocab).to(args.device)
    every = list(range(args.rows))
    apply = _per_window(lambda: apply_bitmask(logits, mask, every), args.windows, args.device)
    print(f"sample_rows without a grammar: {base:.3f} ms a window")
    print(f"sample_rows with a JSON schema on every row: {masked:.3f} ms a window (+{masked - base:.3f} ms, "
          f"{(masked - base) / args.rows * 1000:.1f} us a token; {restarts} schemas completed and restarted)")
    print(f"  of which applying the bitmask to the logits: {apply:.3f} ms a window")
    print(json.dumps({"vocab": vocab, "rows": args.rows, "device": args.device, "base_ms": round(base, 4),
                      "masked_ms": round(masked, 4), "apply_ms": round(apply, 4)}))


if __name__ == "__main__":
    main()
