"""Choosing the next token from logits: every row of a window at once, on the logits' own device.

One call of :func:`sample_rows` picks the tokens of a whole window (``[B, vocab]`` logits, each row
with its own :class:`Sampler`) with torch ops on whatever device holds the logits, and brings the
result to the host in one small copy (the token ids, with log-probabilities when a row asks). The
transforms run in the order of llama.cpp's default sampler chain:

1. ``logit_bias`` added to its tokens' logits; then penalties over the last ``repeat_last_n``
   tokens of ``history``: a repeated token's logit is divided by ``repetition_penalty`` when
   positive and multiplied by it when not, then lowered by ``count * frequency_penalty +
   presence_penalty``; then, for a row whose sampler has a grammar (``constraint``), every token
   the grammar does not allow next set to -inf (serving/token_mask.py: one bitmask for the
   window's constrained rows, filled on the host and copied once);
2. top-k: keep the ``top_k`` largest logits (ties go to the lower id);
3. top-p: keep the smallest set of most likely tokens whose probability reaches ``top_p``;
4. min-p: keep tokens whose probability is at least ``min_p`` times the top one's;
5. temperature: draw from the softmax of the kept logits divided by ``temperature``.

Probabilities in steps 3-4 are those at temperature 1, as in llama.cpp. ``temperature == 0`` is
greedy: the argmax after the penalties (the lowest id on ties), with no randomness at all.

Steps 2-4 run over each row's candidates in descending order with ties in id order: the largest
top-k ``torch.topk`` finds (its ties at the k-th value replaced by the lowest ids), or a stable
sort of the whole row when a row uses top-p without top-k; rows with neither draw over the whole
vocabulary in id order, with no sort. The draw is by inverse CDF: the first token (in that order)
where the running sum of ``exp((logit - max) / temperature)`` over the kept tokens passes ``u``
times their total, with one uniform ``u`` per row. ``u`` is counter-based: a hash of the row's
seed and step (how many tokens its sampler has drawn) in 32-bit integer arithmetic on the host. So a row's token depends only on its own logits, parameters, seed and step,
never on the other rows of the batch, and ``u`` is the same on the CPU and on CUDA.

A constrained row's grammar takes its chosen token before the results are given out; a result
says ``complete`` when the grammar then accepts nothing more (the request is done).

What a request asks and gets (``SamplingParams``, ``SampleResult``) is serving/sampling_params.py.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from strata_core.runtime.devices import PendingRead, to_device
from strata_core.serving.grammar import TokenConstraint
from strata_core.serving.sampling_params import MAX_LOGPROBS, SEED_RANGE, SampleResult, SamplingParams
from strata_core.serving.token_mask import apply_bitmask, fill_bitmask

__all__ = ["MAX_LOGPROBS", "SEED_RANGE", "PendingSamples", "SampleResult", "Sampler", "SamplingBatch", "SamplingParams",
           "sample_rows", "start_sampling"]

_M32 = 0xFFFFFFFF
#: temperatures are clamped into this range in float32: below it the draw is already the top token
#: (every other weight underflows to 0), above it uniform over the kept set; (x - max) / T stays NaN-free
_T_MIN, _T_MAX = 1e-30, 1e30


def _fmix32(h: int) -> int:
    """MurmurHash3's 32-bit finaliser, a bijection of [0, 2**32) that mixes every bit."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def uniform_bits(seed: int, step: int) -> int:
    """53 random bits, a pure function of a row's seed (in [0, 2**64)) and step: counter-based, so
    the same alone, in any batch and on any device. Computed on the host, where it costs a few
    integer operations instead of a chain of kernel launches."""
    k = _fmix32((step & _M32) ^ 0x3C6EF372)
    k = _fmix32(k ^ (seed >> 32))
    a = _fmix32(k ^ (seed & _M32))
    b = _fmix32(a ^ 0x1B873593)
    return ((a >> 5) << 26) | (b >> 6)  # 27 + 26 bits


def uniform(seed: int, step: int) -> float:
    """The row's uniform draw in [0, 1) at ``step``: ``uniform_bits`` scaled (exact in float64)."""
    return uniform_bits(seed, step) * 2.0**-53


@dataclass
class SamplingBatch:
    """The parameters of a window's rows as tensors on the logits' device, with the host-side facts
    that decide which steps run (so choosing the ops never waits on the device).

    Built by :meth:`build` from ``(Sampler, history)`` pairs; :func:`sample_batch` reads it.
    """

    vocab: int
    # per-row scalars, None when every row is greedy (only a drawing row reads them)
    temperature: torch.Tensor | None  # [B] float32, clamped to [_T_MIN, _T_MAX] (unused for greedy rows)
    top_k: torch.Tensor | None  # [B] int64, vocab when off
    top_p: torch.Tensor | None  # [B] float32
    min_p: torch.Tensor | None  # [B] float32
    penalties: torch.Tensor | None  # [B, 3] float32: repetition, frequency, presence
    history: torch.Tensor | None  # [B, L] int64 recent tokens, padded with vocab
    bias_ids: torch.Tensor | None  # [B, nb] int64, padded with 0
    bias_values: torch.Tensor | None  # [B, nb] float32, padded with 0
    u: torch.Tensor | None  # [B] float64: each row's uniform draw for this step (0 for greedy rows)
    sampled: list[int]  # rows that draw (temperature > 0) ...
    filtered: list[int]  # ... and of those, the ones with top-k or top-p (they need the sorted candidates)
    width: int  # candidates the filtered rows need: the largest top-k (the vocabulary for top-p alone)
    any_top_p: bool
    any_min_p: bool
    logprobs: list[int]  # rows that report log-probabilities
    n_top: int  # the most top alternatives a row asks for
    constrained: list[int]  # rows whose sampler has a grammar ...
    mask: torch.Tensor | None  # ... and their allowed tokens: [len(constrained), ceil(vocab / 32)] int32 bitmask

    @classmethod
    def build(cls, rows: Sequence[tuple[Sampler, Sequence[int]]], vocab: int, device: torch.device | str) -> SamplingBatch:
        """The batch of ``rows`` (a sampler and its sequence's tokens so far each) for logits of
        ``vocab`` columns on ``device``. Bias and history ids outside the vocabulary are ignored."""
        if not 0 < vocab < 2**24:
            raise ValueError(f"a vocabulary of {vocab} tokens: ids must stay exact in float32")
        params = [s.params for s, _ in rows]
        hists, biases = [], []
        for p, (_, history) in zip(params, rows):
            penalised = p.repeat_last_n and (p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty)
            recent = list(history[-p.repeat_last_n:]) if penalised and len(history) else []
            hists.append([t if 0 <= t < vocab else vocab for t in recent])
            biases.append([(i, b) for i, b in p.logit_bias if i < vocab])
        f32, i64 = {"dtype": torch.float32}, {"dtype": torch.int64}  # built on the host, copied without a wait
        history = penalties = bias_ids = bias_values = None
        if any(hists):
            width = max(map(len, hists))
            history = to_device(torch.tensor([h + [vocab] * (width - len(h)) for h in hists], **i64), device)
            penalties = to_device(torch.tensor([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty]
                                          for p in params], **f32), device)
        if any(biases):
            width = max(map(len, biases))
            bias_ids = to_device(torch.tensor([[i for i, _ in b] + [0] * (width - len(b)) for b in biases], **i64), device)
            bias_values = to_device(torch.tensor([[v for _, v in b] + [0.0] * (width - len(b)) for b in biases], **f32),
                              device)
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        sampled = [r for r, p in enumerate(params) if not p.greedy]
        filtered = [r for r in sampled if ks[r] < vocab or params[r].top_p < 1]
        scalars = _row_scalars(rows, ks, sampled, device) if sampled else (None,) * 5
        constrained = [r for r, (s, _) in enumerate(rows) if s.constraint is not None]
        mask = to_device(fill_bitmask([rows[r][0].constraint for r in constrained], vocab), device) if constrained else None
        return cls(
            vocab=vocab,
            temperature=scalars[0], top_p=scalars[1], min_p=scalars[2], top_k=scalars[3], u=scalars[4],
            penalties=penalties, history=history, bias_ids=bias_ids, bias_values=bias_values,
            sampled=sampled,
            filtered=filtered,
            width=max((ks[r] for r in filtered), default=0),
            any_top_p=any(params[r].top_p < 1 for r in sampled),
            any_min_p=any(params[r].min_p > 0 for r in sampled),
            logprobs=[r for r, p in enumerate(params) if p.logprobs is not None],
            n_top=max((p.logprobs or 0 for p in params), default=0),
            constrained=constrained,
            mask=mask,
        )


def _row_scalars(rows: Sequence[tuple[Sampler, Sequence[int]]], ks: list[int], sampled: list[int],
                 device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """Temperature, top-p, min-p (float32), top-k (int64) and the uniform draw (float64) of every
    row on ``device``, in two non-blocking copies; greedy rows draw nothing (u = 0)."""
    drawing = set(sampled)
    floats = to_device(torch.tensor([[min(max(s.params.temperature, _T_MIN), _T_MAX), s.params.top_p, s.params.min_p]
                               for s, _ in rows], dtype=torch.float32), device)  # [B, 3]
    bits = [uniform_bits(s.seed, s.step) if r in drawing else 0 for r, (s, _) in enumerate(rows)]
    ints = to_device(torch.tensor([[k, b] for k, b in zip(ks, bits)], dtype=torch.int64), device)  # [B, 2]
    return floats[:, 0], floats[:, 1], floats[:, 2], ints[:, 0], ints[:, 1].double() * 2.0**-53


def _rows(t: torch.Tensor, rows: list[int], total: int) -> torch.Tensor:
    """``t[rows]``, without a copy when ``rows`` is every row."""
    if len(rows) == total:
        return t
    return t.index_select(0, to_device(torch.tensor(rows, dtype=torch.long), t.device))


def _penalize(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Step 1 on ``[B, V]`` float32 logits: logit bias, then the penalties (out of place)."""
    if batch.bias_ids is not None:
        x = x.scatter_add(1, batch.bias_ids, batch.bias_values)
    if batch.history is not None:
        ones = torch.ones(batch.history.shape, dtype=x.dtype, device=x.device)
        counts = torch.zeros(x.shape[0], x.shape[1] + 1, dtype=x.dtype, device=x.device)
        counts = counts.scatter_add_(1, batch.history, ones)[:, :-1]  # the padding column dropped
        rep, freq, pres = (batch.penalties[:, i : i + 1] for i in range(3))
        penalised = torch.where(x <= 0, x * rep, x / rep) - counts * freq - pres
        x = torch.where(counts > 0, penalised, x)
    return x


def _top_candidates(x: torch.Tensor, k: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``width`` largest logits of each row of ``x`` and their ids, in descending order with
    ties in id order (a stable sort's order), exact in the first ``k`` of each row (the rest are
    never kept): ``torch.topk`` finds the values, and the ties at each row's k-th value, which
    it may pick in any order, are replaced by the lowest ids holding that value."""
    vocab = x.shape[1]
    if width >= vocab:
        return torch.sort(x, dim=-1, descending=True, stable=True)
    values, ids = torch.topk(x, width, dim=-1)
    ids, perm = torch.sort(ids, dim=-1)  # then a stable sort by value: ties in id order
    values, perm = torch.sort(values.gather(1, perm), dim=-1, descending=True, stable=True)
    ids = ids.gather(1, perm)
    kth = values.gather(1, (k - 1)[:, None])
    above = (values > kth).sum(dim=-1, keepdim=True)  # every logit above the k-th value is here
    tie_ids = torch.arange(vocab, device=x.device, dtype=torch.float32).neg().masked_fill(x != kth, -math.inf)
    tie_ids = torch.topk(tie_ids, width, dim=-1).values.neg()  # the lowest ids holding the k-th value
    rank = torch.arange(width, device=x.device)
    from_ties = tie_ids.gather(1, (rank - above).clamp(0, width - 1)).nan_to_num(0, 0, 0).long()
    return values, torch.where(rank < above, ids, from_ties)


def _kept(values: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """Steps 2-4 over each row's candidates (descending, stable order): the bool mask of those
    top-k, top-p and min-p keep. The first always stays."""
    rank = torch.arange(values.shape[1], device=values.device)
    kept = rank < k[:, None]
    shifted = values - values[:, :1]
    if top_p is not None:
        w = torch.exp(shifted).masked_fill(~kept, 0)  # probabilities at temperature 1, unnormalised
        cum = torch.cumsum(w, dim=-1, dtype=torch.float64)
        before = cum - w  # mass of the more likely tokens
        kept &= (before < top_p.double()[:, None] * cum[:, -1:]) | (rank == 0)
    if min_p is not None:
        kept &= shifted >= torch.log(min_p)[:, None]  # log(0) = -inf: all stay
    return kept


def _draw(shifted: torch.Tensor, kept: torch.Tensor | None, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws from the tempered softmax: per row the first position where the running
    sum of ``exp(shifted / T)`` over the kept entries passes ``u`` times their total (``shifted``
    is ``logit - max``, so the top weight is exactly 1 and the total is at least 1)."""
    w = torch.exp(shifted / temperature[:, None])
    if kept is not None:
        w = w.masked_fill(~kept, 0)
    cum = torch.cumsum(w, dim=-1, dtype=torch.float64)
    pos = torch.searchsorted(cum, (u * cum[:, -1])[:, None], right=True)
    return pos.clamp_max(w.shape[1] - 1)[:, 0]


def _sampled_tokens(x: torch.Tensor, top: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The drawn token of each sampled row (``x`` and ``top`` hold only those rows, in order)."""
    rows, n = batch.sampled, x.shape[0]
    temperature, u, min_p = (_rows(t, rows, len(t)) for t in (batch.temperature, batch.u, batch.min_p))
    token = torch.zeros(n, dtype=torch.long, device=x.device)
    plain = [i for i, r in enumerate(rows) if r not in batch.filtered]
    if plain:  # no top-k or top-p: draw in id order over the whole vocabulary
        xs, ts = _rows(x, plain, n), _rows(top, plain, n)
        shifted = xs - ts[:, None]
        kept = shifted >= torch.log(_rows(min_p, plain, n))[:, None] if batch.any_min_p else None
        drawn = _draw(shifted, kept, _rows(temperature, plain, n), _rows(u, plain, n))
        token = token.index_copy(0, to_device(torch.tensor(plain, dtype=torch.long), x.device), drawn)
    if batch.filtered:  # over each row's sorted candidates
        among = [rows.index(r) for r in batch.filtered]
        k = _rows(batch.top_k, batch.filtered, len(batch.top_k))
        values, ids = _top_candidates(_rows(x, among, n), k, batch.width)
        kept = _kept(values, k, _rows(batch.top_p, batch.filtered, len(batch.top_p)) if batch.any_top_p else None,
                     _rows(min_p, among, n) if batch.any_min_p else None)
        pos = _draw(values - values[:, :1], kept, _rows(temperature, among, n), _rows(u, among, n))
        drawn = ids.gather(1, pos[:, None])[:, 0]
        token = token.index_copy(0, to_device(torch.tensor(among, dtype=torch.long), x.device), drawn)
    return token


def sample_batch(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The window's choice on the logits' device, packed in one float64 tensor ``[B, 3 + 2 n]``:
    per row the token id, 1.0 where it could not be chosen (the logits are not finite), the
    chosen token's log-probability, then the ids and log-probabilities of the ``n`` most likely
    tokens (NaN for rows that asked for none)."""
    n_rows, vocab = logits.shape
    raw = logits.detach().to(torch.float32)
    x = _penalize(raw, batch)
    if batch.mask is not None:
        x = apply_bitmask(x, batch.mask, batch.constrained)
    top, token = x.max(dim=-1)  # the first maximum: the lowest id on ties
    bad = torch.isnan(top)
    if batch.sampled:
        rows = batch.sampled
        ts = _rows(top, rows, n_rows)
        drawn = _sampled_tokens(_rows(x, rows, n_rows), ts, batch)
        if len(rows) == n_rows:
            token, bad = drawn, ~torch.isfinite(top)
        else:
            index = to_device(torch.tensor(rows, dtype=torch.long), x.device)
            token = token.index_copy(0, index, drawn)
            bad = bad.index_copy(0, index, ~torch.isfinite(ts))
    columns = [token.double()[:, None], bad.double()[:, None]]
    lp = torch.full((n_rows, 1 + 2 * batch.n_top), math.nan, dtype=torch.float64, device=x.device)
    if batch.logprobs:
        rows = batch.logprobs
        logp = torch.log_softmax(_rows(raw, rows, n_rows), dim=-1)
        parts = [logp.gather(1, _rows(token, rows, n_rows)[:, None]).double()]
        if batch.n_top:
            best = torch.topk(logp, min(batch.n_top, vocab), dim=-1)
            parts += [best.indices.double(), best.values.double()]
        packed = torch.cat(parts, dim=1)
        if len(rows) == n_rows and packed.shape[1] == lp.shape[1]:
            lp = packed
        else:
            lp[to_device(torch.tensor(rows, dtype=torch.long), x.device), : packed.shape[1]] = packed
    return torch.cat(columns + [lp], dim=1)


class PendingSamples:
    """A window's choice enqueued on the logits' device (``start_sampling``): ``tokens`` ``[B]`` int64 there
    (a next window can read them without the host), ``results`` once the host needs them."""

    def __init__(self, packed: torch.Tensor, rows: Sequence[tuple[Sampler, Sequence[int]]], n_top: int) -> None:
        self.tokens = packed[:, 0].long()
        self._rows, self._n_top = rows, n_top
        self._read = PendingRead(packed)  # copied to the host without making it wait

    def results(self) -> list[SampleResult | Exception]:
        """Each row's token (waiting for the copy): a row whose logits could not be sampled gets a
        ``FloatingPointError`` in its place. Each sampler that chose a token advances its step (and
        its grammar takes the token)."""
        out: list[SampleResult | Exception] = []
        for (sampler, _), row in zip(self._rows, self._read.tolist()):
            if row[1]:
                out.append(FloatingPointError("cannot sample: the logits are not finite (NaN or infinite)"))
                continue
            sampler.step += 1
            token, n = int(row[0]), sampler.params.logprobs
            try:
                complete = sampler.constraint is not None and sampler.constraint.advance(token)
            except RuntimeError as exc:
                out.append(exc)
                continue
            if n is None:
                out.append(SampleResult(token, complete=complete))
                continue
            ids, values = row[3 : 3 + self._n_top], row[3 + self._n_top :]
            out.append(SampleResult(token, row[2], tuple((int(i), v) for i, v in zip(ids[:n], values[:n])), complete))
        return out


def start_sampling(logits: torch.Tensor, rows: Sequence[tuple[Sampler, Sequence[int]]]) -> PendingSamples:
    """Enqueue the choice of each row of ``logits`` ``[B, V]`` (``rows[i]``: row i's sampler and its
    sequence's tokens so far, prompt and generated) on their device, and one device-to-host copy of it."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} for {len(rows)} rows")
    batch = SamplingBatch.build(rows, logits.shape[1], logits.device)
    return PendingSamples(sample_batch(logits, batch), rows, batch.n_top)


def sample_rows(logits: torch.Tensor, rows: Sequence[tuple[Sampler, Sequence[int]]]) -> list[SampleResult | Exception]:
    """The next token of each row of ``logits`` ``[B, V]`` (``start_sampling``, then its results): one
    device-to-host copy for the window; a row whose logits cannot be sampled gets a
    ``FloatingPointError`` in its place, the others go on."""
    return start_sampling(logits, rows).results()


class Sampler:
    """One sequence's sampling state: its parameters, its seed, how many tokens it has drawn, and
    the grammar its tokens must follow (``constraint``; None: any token).

    ``sample`` / ``sample_result`` choose for one sequence (a window of one row of
    :func:`sample_rows`: on the logits' device, the same code as a batch).
    """

    def __init__(self, params: SamplingParams, constraint: TokenConstraint | None = None) -> None:
        self.params = params
        self.constraint = constraint
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        self.seed = seed % 2**64
        self.step = 0

    def sample(self, logits: torch.Tensor, history: Sequence[int] | Sequence[Sequence[int]] = ()) -> int | list[int]:
        """The next token for logits ``[V]`` (an int), or one per row of ``[B, V]`` (a list; the rows
        are successive draws of this sequence, each advancing the step).

        ``history`` is the sequence's tokens so far (prompt and generated), a list per row for ``[B, V]``.
        """
        if logits.dim() == 1:
            return self.sample_result(logits, history).token  # type: ignore[arg-type]
        rows = history if len(history) else [()] * logits.shape[0]
        if len(rows) != logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} rows of logits but {len(rows)} histories")
        return [self.sample_result(row, hist).token for row, hist in zip(logits, rows)]  # type: ignore[arg-type]

    def sample_result(self, logits: torch.Tensor, history: Sequence[int] = ()) -> SampleResult:
        """Like ``sample`` for one row ``[V]``, with log-probabilities when ``params.logprobs`` is set;
        raises ``FloatingPointError`` when the logits cannot be sampled."""
        (result,) = sample_rows(logits[None], [(self, history)])
        if isinstance(result, Exception):
            raise result
        return result

    def penalize(self, logits: torch.Tensor, history: Sequence[int]) -> torch.Tensor:
        """Step 1 for one row ``[V]``: logit bias, then repetition, frequency and presence penalties
        over the recent history (a new tensor)."""
        batch = SamplingBatch.build([(self, history)], logits.shape[-1], logits.device)
        return _penalize(logits.to(torch.float32)[None], batch)[0]

    def allowed(self, logits: torch.Tensor) -> torch.Tensor:
        """Steps 2-4 for one row ``[V]``: a bool mask of the tokens top-k, top-p and min-p leave (never
        empty), as a sampled row with this sampler's parameters sees them."""
        p, vocab = self.params, logits.shape[-1]
        x = logits.to(torch.float32)[None]
        k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab], device=x.device)
        values, ids = _top_candidates(x, k, int(k))
        kept = _kept(values, k, torch.tensor([p.top_p], device=x.device) if p.top_p < 1 else None,
                     torch.tensor([p.min_p], device=x.device) if p.min_p > 0 else None)
        mask = torch.zeros(x.shape, dtype=torch.int8, device=x.device)
        return mask.scatter_reduce(1, ids, kept.to(torch.int8), "amax")[0].bool()
