"""The step plan (hypothesis): the budget holds, decode rows always run, prompt chunks go oldest
first, and in a simulated server every request finishes its prompt within the documented bound; with
``piece`` (``--batch-invariant``) a prompt's cuts do not depend on what else the steps hold."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from strata_core.serving.step_plan import plan_step


@given(decoding=st.integers(0, 16), lefts=st.lists(st.integers(1, 3000), max_size=8),
       step_tokens=st.integers(1, 1024), idle_tokens=st.integers(0, 4096))
def test_one_plan_keeps_the_budget_and_the_order(decoding: int, lefts: list[int], step_tokens: int,
                                                 idle_tokens: int) -> None:
    prefilling = [(f"r{i}", left) for i, left in enumerate(lefts)]
    plan = plan_step(list(range(decoding)), prefilling, step_tokens, idle_tokens)
    assert plan.decode == tuple(range(decoding))  # every decoding stream gets its row
    budget = max(step_tokens - decoding, 0) if decoding else max(step_tokens, idle_tokens)
    if decoding:  # decode rows count against the budget; only rows that must run go past it
        assert decoding + plan.prompt_tokens <= max(step_tokens, decoding)
    else:  # no stream waits on this step: the engine's own chunk is allowed
        assert plan.prompt_tokens <= max(step_tokens, idle_tokens)
    # oldest first and work-conserving: the chunks take the prompts in order, each but the last whole
    assert plan.prompt_tokens == min(sum(lefts), budget)
    assert [key for key, _ in plan.chunks] == [key for key, _ in prefilling[: len(plan.chunks)]]
    for (_, n), (_, left) in zip(plan.chunks, prefilling):
        assert 0 < n <= left
    assert all(n == left for (_, n), (_, left) in zip(plan.chunks[:-1], prefilling))


@given(prompt=st.integers(1, 3000), parallel=st.integers(1, 16), spare=st.integers(0, 600),
       decoding=st.lists(st.integers(0, 15), min_size=1, max_size=40), idle_tokens=st.integers(0, 4096))
def test_with_pieces_a_prompt_is_cut_only_between_pieces(prompt: int, parallel: int, spare: int,
                                                                    decoding: list[int], idle_tokens: int) -> None:
    step_tokens = parallel + spare
    piece = step_tokens - parallel + 1
    left, cuts, step = prompt, [], 0
    while left:  # the oldest prompt beside 0 .. parallel - 1 decoding streams, as many as each step has
        rows = decoding[step % len(decoding)] % parallel
        plan = plan_step(list(range(rows)), [("oldest", left), ("next", 5)], step_tokens, idle_tokens, piece)
        assert plan.chunks and plan.chunks[0][0] == "oldest"  # it always moves on: no starvation
        assert rows + plan.prompt_tokens <= (step_tokens if rows else max(step_tokens, idle_tokens))
        left -= plan.chunks[0][1]
        cuts.append(prompt - left)
        step += 1
    assert all(cut % piece == 0 for cut in cuts[:-1])


@dataclass
class _Request:
    arrives: int  # the step it is submitted before
    prompt: int  # prompt tokens to compute
    output: int  # tokens it generates
    left: int = 0
    decode_left: int = 0
    admitted: int = -1
    bound: int = 0  # steps its prefill may take, from the tokens ahead of it at admission
    prefilled: int = -1  # the step its last chunk ran in


@settings(max_examples=150, deadline=None)
@given(parallel=st.integers(1, 6), spare=st.integers(0, 64), idle_tokens=st.integers(0, 256), pieces=st.booleans(),
       requests=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 400), st.integers(1, 30)),
                         min_size=1, max_size=24))
def test_no_request_starves_in_a_simulated_server(parallel: int, spare: int, idle_tokens: int, pieces: bool,
                                                  requests: list[tuple[int, int, int]]) -> None:
    """The scheduler's loop on a model of the engine: free slots go to the oldest waiting request,
    a chunk that ends a prompt samples the first token, then one token per step until ``output``."""
    step_tokens = parallel + spare  # the least the settings allow, and more
    piece = step_tokens - parallel + 1 if pieces else 0
    reqs = sorted((_Request(a, p, o) for a, p, o in requests), key=lambda r: r.arrives)
    waiting: list[_Request] = []
    slots: list[_Request | None] = [None] * parallel
    arrivals = iter(reqs)
    pending = next(arrivals, None)
    step = 0
    while pending is not None or waiting or any(slots):
        while pending is not None and pending.arrives <= step:
            waiting.append(pending)
            pending = next(arrivals, None)
        for i in range(parallel):
            if slots[i] is None and waiting:
                r = slots[i] = waiting.pop(0)
                ahead = [s.left for s in slots if s is not None and s is not r and s.left] + [r.prompt]
                r.admitted, r.left = step, r.prompt
                r.bound = (sum(math.ceil(left / piece) for left in ahead) if piece
                           else math.ceil(sum(ahead) / (step_tokens - parallel + 1)))
        busy = [s for s in slots if s is not None]
        decoding = [s for s in busy if not s.left]
        prefilling = sorted((s for s in busy if s.left), key=lambda s: s.admitted)
        plan = plan_step(decoding, [(s, s.left) for s in prefilling], step_tokens, idle_tokens, piece)
        assert len(plan.decode) + plan.prompt_tokens <= (step_tokens if decoding else max(step_tokens, idle_tokens))
        if prefilling:
            assert plan.chunks and plan.chunks[0][0] is prefilling[0]  # the oldest always moves on
        for r in plan.decode:
            r.decode_left -= 1
        for r, n in plan.chunks:
            r.left -= n
            if not r.left:
                r.prefilled, r.decode_left = step, r.output - 1  # the first token comes with the last chunk
        slots = [None if s is not None and not s.left and s.decode_left == 0 else s for s in slots]
        step += 1
        assert step < 100_000, "the simulated server did not drain"
    for r in reqs:
        assert r.prefilled - r.admitted + 1 <= r.bound, (r, step_tokens)
    by_admission = sorted(reqs, key=lambda r: (r.admitted, r.arrives))
    assert [r.prefilled for r in by_admission] == sorted(r.prefilled for r in by_admission)  # first in, first out
