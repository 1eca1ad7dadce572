"""``cpu_prompt_tokens``: how short a prompt chunk must be for a GPU to split its misses between the host
link and the CPU as a decode token's are split, instead of streaming every miss over the link.

A prompt chunk copies each missed expert over the link once, however many of its rows route there: a
layer's link time is about the missed experts' bytes over the link's rate. The CPU computes a missed
expert where it lies, decoding its blocks once for every 8 rows (ops/cpu_kernels.py), so its time grows
with the rows each expert gets. The load-time probe (split_auto.py ``measure_rates``) times the CPU at
one row an expert and at ``PROBE_ROWS`` rows; in between, its seconds per byte are taken as linear in
the rows (never falling), and nothing is estimated beyond ``PROBE_ROWS``. A chunk of ``T`` tokens, each
routed to ``k`` of ``E`` experts, gives a routed expert ``T k / (E (1 - (1 - k/E)^T))`` rows on average
(uniform routing).

Split as the decode splits it (link share ``f``: the fixed ``--pcie-frac``, or under ``auto`` the share
the probe's rates balance, which the learned split starts from), a layer's misses take the longer of
the link's share (``f`` of the time streaming them all takes) and the CPU's share (``1 - f`` of their
bytes at the CPU's seconds per byte for those rows); the chunk splits where the CPU's side is
estimated shorter than streaming every miss. Both sides grow with the number of misses, so the answer
does not depend on how many there are. ``cpu_prompt_tokens`` is the largest such ``T``: 0 where the
decode sends no miss to the CPU (``f`` = 1) or even a one-token chunk is estimated slower.
"""

from __future__ import annotations

import logging

from strata_core.experts.split_auto import PROBE_ROWS, Rates

__all__ = ["cpu_prompt_tokens", "cpu_seconds_per_gb", "decide_cpu_prompt_tokens", "rows_per_expert"]

log = logging.getLogger(__name__)


def rows_per_expert(tokens: int, n_experts: int, n_used: int) -> float:
    """The mean (token, k) pairs of a routed expert in a chunk of ``tokens`` tokens, each routed to
    ``n_used`` of ``n_experts`` experts uniformly: the pairs over the expected distinct experts."""
    distinct = n_experts * (1.0 - (1.0 - n_used / n_experts) ** tokens)
    return tokens * n_used / distinct


def cpu_seconds_per_gb(rates: Rates, rows: float) -> float:
    """Seconds the CPU takes for a GB of missed experts' blocks at ``rows`` rows an expert: linear through
    the probe's figures at one row and at ``PROBE_ROWS`` rows, never falling with the rows."""
    one, many = 1.0 / rates.cpu, 1.0 / rates.cpu_rows
    return one + max(many - one, 0.0) * (rows - 1.0) / (PROBE_ROWS - 1)


def cpu_prompt_tokens(rates: Rates, link_share: float, n_experts: int, n_used: int, limit: int) -> int:
    """The largest prompt chunk, in tokens (at most ``limit``, and at most ``PROBE_ROWS`` rows an expert),
    whose misses split with ``link_share`` of them over the link are estimated to finish before streaming
    them all: the CPU's share at the chunk's rows an expert takes less than the link takes for every
    miss. 0 where ``link_share`` is 1 or even one token is estimated slower (the module docstring has
    the model)."""
    if link_share >= 1.0 or min(rates.cpu, rates.cpu_rows, rates.link) <= 0.0:
        return 0
    link_seconds = 1.0 / rates.link  # a GB of misses streamed

    def splits(tokens: int) -> bool:
        rows = rows_per_expert(tokens, n_experts, n_used)
        return rows <= PROBE_ROWS and (1.0 - link_share) * cpu_seconds_per_gb(rates, rows) < link_seconds

    tokens = 0
    while tokens < limit and splits(tokens + 1):  # the rows, and with them the CPU's side, grow with the tokens
        tokens += 1
    return tokens


def decide_cpu_prompt_tokens(rates: Rates | None, link_share: float, n_experts: int, n_used: int, limit: int,
                             where: str) -> int:
    """``cpu_prompt_tokens`` for the GPU ``where`` whose decode sends ``link_share`` of its misses over the
    link, 0 where the probe's ``rates`` are unknown (None); the answer and what it came from are logged."""
    if rates is None:
        log.info("cpu prompt tokens on %s: 0 (the CPU's rate is unknown: prompt chunks stream every miss)", where)
        return 0
    tokens = cpu_prompt_tokens(rates, link_share, n_experts, n_used, limit)
    measured = (f"the CPU computes misses at {rates.cpu:.1f} GB/s at one row an expert and {rates.cpu_rows:.1f} GB/s "
                f"at {PROBE_ROWS} rows, the link moves them at {rates.link:.1f} GB/s")
    if tokens:
        log.info("cpu prompt tokens on %s: %d (a prompt chunk of at most that many tokens splits its misses as the "
                 "decode does, %.2f over the link; a longer one streams them all): %s", where, tokens, link_share,
                 measured)
    else:
        log.info("cpu prompt tokens on %s: 0 (every prompt chunk streams its misses; the decode sends %.2f of them "
                 "over the link): %s", where, link_share, measured)
    return tokens
