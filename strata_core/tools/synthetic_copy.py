"""A synthetic qwen3moe whose greedy output copies its prompt (``strata make-synthetic --copy``).

Random synthetic weights do not repeat their prompt, so prompt-lookup drafts (``--spec ngram``) are
rarely kept on them. This model is a stand-in for a real model's tendency to repeat its prompt, for
speculation benchmarks: the same tensors, shapes, block types and bytes as the random preset (so the
same speed), with a few of them set by hand to an induction ("copy") circuit:

* The residual stream holds subspaces: ``C`` (a constant every embedding carries, ``_C`` coordinates
  of 1, which makes the RMS norms nearly linear), ``E`` (the token's code ``e_t``: random unit
  sub-blocks), ``P1`` / ``P2`` (the codes of the tokens 1 and 2 positions back) and ``O`` (the code
  of the predicted token).
* Layer 0 attention: previous-token heads. q and k come from ``C`` alone, so after the q/k norm they
  are constant vectors; q is k rotated back by 1 (or 2) positions over the high-frequency RoPE pairs,
  so the score peaks sharply at that offset. The value is ``E``, written to ``P1`` (``P2``).
* Layer 1 attention: the induction head, one query head per kv head (independent codes: they vote).
  Its key at position j holds the codes of tokens j-1 and j-2 (``P1``, ``P2``), its query at i those
  of tokens i and i-1 (``E``, ``P1``), both in the low-frequency RoPE pairs (little rotation over
  ``COPY_CONTEXT`` tokens); the current token's match weighs twice the previous one's, so the best
  key is the latest-ish occurrence of the longest suffix (up to 2 tokens). A fit of ``-log(1 + Δ)``
  in the other pairs prefers recent matches among equal ones. The value is ``E``, written to ``O``:
  the code of the token that followed.
* The output head reads ``O``: logit_t = <O, e_t> (scaled), so greedy decoding emits the token that
  followed the matched context, as prompt lookup would draft it.
* Every other layer adds nothing (attention output and the experts' down projections are zero blocks:
  exactly zero), but computes what the random preset computes: its q/k/v, router and expert gate/up
  weights are the random preset's, the routers blind to ``C`` so routing still spreads over experts.

Where the context never occurred before the output is arbitrary; a prompt that holds the text to
repeat (tools/data/code_edit.jsonl) makes the copy go on.

The model's tokenizer (``code_tokenizer``) is a Qwen2-style byte-level BPE of up to ``CODE_VOCAB``
tokens trained on Python code, a stand-in for a real tokenizer trained on a corpus with code: runs of
indentation and common identifiers are single tokens, so a code prompt is a few hundred tokens of many
distinct ones (the toy tokenizer of the random presets cuts it into ~1 token a character of ~80 distinct
ones, every space its own token, where a two-token context says little about what follows).
"""

from __future__ import annotations

import math
import re
import sysconfig
from pathlib import Path

import numpy as np
import tokenizers
from gguf import GGMLQuantizationType as Q

from strata_core.errors import ConfigError
from strata_core.model.preset import Preset
from strata_core.quant import QUANTIZABLE_TYPES, quantize
from strata_core.text.tokenizer import train_byte_level_bpe

__all__ = ["CODE_VOCAB", "COPY_CONTEXT", "CopyCircuit", "code_corpus", "code_tokenizer"]

#: the most tokens the copy model's code tokenizer learns (trained in about a second)
CODE_VOCAB = 16384

#: the context over which the copy circuit is designed to be reliable (RoPE rotation of its codes)
COPY_CONTEXT = 2048
_C = 32  # coordinates of the constant direction (one Q8_0 block: quantized exactly)
_PREV_SCORE = 200.0  # previous-token heads: score at the wanted offset, in nats
_MATCH = 20.0  # induction head: nats per matched token (the current token's match counts twice)
_RECENCY = 2.0  # induction head: nats per e-fold of distance that a more recent match is preferred by
_LOGIT = 30.0  # output head: the logit of a copied token
_CONTENT_TURN = 0.5  # the most the induction codes' RoPE pairs turn over COPY_CONTEXT tokens (radians)
_RIDGE = 1.0  # the recency fit's ridge weight
_EMBED_ROWS = 1 << 13  # embedding / output rows quantized at a time (bounded memory at 152K x 2048)
_ROUTER = "ffn_gate_inp.weight"


def code_corpus() -> list[str]:
    """The training text of ``code_tokenizer``: the Python standard library's top-level modules
    (``sysconfig``'s stdlib folder, ``*.py`` in sorted order, about 4.7 MB), Python code that is not the
    benchmark's prompts (those quote strata's own source). The same for one Python version."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if not files:
        raise ConfigError(f"--copy trains its tokenizer on the Python standard library's sources, not found in "
                          f"{sysconfig.get_paths()['stdlib']}")
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def code_tokenizer(vocab: int, special_tokens: list[str]) -> tokenizers.Tokenizer:
    """A Qwen2-style byte-level BPE of ``min(vocab, CODE_VOCAB)`` tokens trained on ``code_corpus()``."""
    return train_byte_level_bpe(code_corpus(), vocab_size=min(vocab, CODE_VOCAB), special_tokens=special_tokens)


def _unit_rows(rng: np.random.Generator, n: int, d: int) -> np.ndarray:
    """``[n, d]`` random unit vectors."""
    x = rng.standard_normal((n, d), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _angles(p: Preset) -> np.ndarray:
    """``[D / 2]`` RoPE angle per position of each rotated pair (plain RoPE, NEOX pairs (f, f + D/2))."""
    return p.rope_theta ** (-np.arange(0, p.head_dim, 2, dtype=np.float64) / p.head_dim)


def _offset_pairs(theta: np.ndarray, context: int) -> tuple[int, float]:
    """How many of the highest-frequency pairs an offset head uses (equal weights) and the margin it
    gets: min over offsets x in [1, context] of mean(1 - cos(x theta)), the largest over the choices."""
    x = np.arange(1, context + 1, dtype=np.float64)[:, None]
    best = (1, 0.0)
    for n in range(1, len(theta) + 1):
        margin = float((1 - np.cos(x * theta[:n])).mean(axis=1).min())
        if margin > best[1]:
            best = (n, margin)
    return best


def _recency_fit(theta: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
    """Cos and sin weights ``[n]`` of pairs ``theta`` whose sum over offsets Δ in [0, context] fits
    ``-_RECENCY log(1 + Δ)`` up to a constant: ridge least squares (plain least squares is ill-posed
    here, with weights of 1e10 that bf16 scores could not carry; this one sums to about 25 nats)."""
    d = np.arange(context + 1, dtype=np.float64)[:, None]
    basis = np.concatenate([np.cos(d * theta), np.sin(d * theta)], axis=1)
    basis -= basis.mean(axis=0)  # the constant is free (softmax ignores it)
    target = -_RECENCY * np.log1p(d[:, 0])
    target -= target.mean()
    coef = np.linalg.solve(basis.T @ basis + _RIDGE * np.eye(basis.shape[1]), basis.T @ target)
    return coef[:len(theta)], coef[len(theta):]


class CopyCircuit:
    """The hand-set tensors of a copy model of preset ``p`` (see the module docstring): ``value``
    replaces a tensor's random value by the circuit's where the circuit sets it."""

    def __init__(self, p: Preset, dense_type: Q, seed: int):
        if p.architecture != "qwen3moe":
            raise ConfigError(f"--copy builds a qwen3moe (presets: qwen3-30b-a3b, small, tiny, ...), not "
                              f"{p.architecture}")
        if dense_type not in QUANTIZABLE_TYPES:
            raise ConfigError(f"--copy quantizes its dense matrices: --dense-type one of "
                              f"{', '.join(sorted(t.name for t in QUANTIZABLE_TYPES))}, not {dense_type.name}")
        self.p, self.dense_type = p, dense_type
        self.dim = min(p.head_dim, (p.hidden - _C) // 4 // 32 * 32)  # width of E, P1, P2, O
        if self.dim < 32 or p.n_layers < 2 or p.n_heads < 2 * p.n_kv_heads:
            raise ConfigError("--copy needs 2 layers, a hidden size of 160 or more and 2 query heads a kv head")
        self.context = min(p.context, COPY_CONTEXT)
        rng = np.random.default_rng(seed + 1)  # its own stream: the random tensors stay the preset's
        self.theta = _angles(p)
        half = p.head_dim // 2
        # the induction codes' pairs: the lowest frequencies, turning at most _CONTENT_TURN over the context
        first = int(np.argmax(self.theta * self.context <= _CONTENT_TURN))
        self.slot_pairs = (half - first) // 2  # pairs per matched token
        if self.slot_pairs < 2:
            raise ConfigError(f"--copy: head_dim {p.head_dim} leaves too few slow RoPE pairs for its codes")
        self.code = 2 * self.slot_pairs  # a code's width: the real and imaginary parts of its pairs
        self.n_codes = self.dim // self.code  # independent codes in E (one per kv head, cycling)
        self.codes = _unit_rows(rng, p.vocab * self.n_codes, self.code).reshape(p.vocab, self.n_codes, self.code)
        self.first_content = half - 2 * self.slot_pairs

    # --- the residual layout and the embeddings

    def embedding(self, rows: slice) -> np.ndarray:
        """``[n, dim]`` codes ``e_t`` of tokens ``rows`` (unit norm: unit sub-blocks over sqrt(n_codes))."""
        codes = self.codes[rows]  # [n, n_codes, code]
        out = np.zeros((codes.shape[0], self.dim), dtype=np.float32)
        out[:, :self.n_codes * self.code] = codes.reshape(codes.shape[0], -1) / math.sqrt(self.n_codes)
        return out

    def space(self, name: str) -> slice:
        """The residual coordinates of subspace ``name`` (C, E, P1, P2 or O)."""
        if name == "C":
            return slice(0, _C)
        start = _C + self.dim * ["E", "P1", "P2", "O"].index(name)
        return slice(start, start + self.dim)

    def code_of(self, name: str, group: int) -> slice:
        """The coordinates of kv head ``group``'s code inside subspace ``name``."""
        start = self.space(name).start + (group % self.n_codes) * self.code
        return slice(start, start + self.code)

    def _rms(self, spaces: int) -> float:
        """The RMS of a residual holding C and ``spaces`` unit codes (what the norms divide by)."""
        return math.sqrt((_C + spaces) / self.p.hidden)

    # --- the tensors

    def value(self, name: str, shape: tuple[int, ...], qtype: Q, data: np.ndarray) -> np.ndarray:
        """Tensor ``name``'s data in the copy model: the circuit's, or ``data`` (the random preset's)
        with the circuit's changes (zero blocks, routers blind to C)."""
        match = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        if match is None:
            return self._global(name, shape, qtype, data)
        layer, part = int(match[1]), match[2]
        if part == "ffn_down_exps.weight" or (layer >= 2 and part == "attn_output.weight"):
            return np.zeros_like(data)  # zero blocks of every type are exact zeros
        if part == _ROUTER:
            data = data.copy()
            data[:, self.space("C")] = 0.0  # the constant would route every token alike
            return data
        if layer < 2 and part.startswith("attn_"):
            values = (self._offset_heads if layer == 0 else self._induction_heads)(part)
            return values if qtype == Q.F32 else quantize(values, qtype)
        return data

    def _global(self, name: str, shape: tuple[int, ...], qtype: Q, data: np.ndarray) -> np.ndarray:
        """The embedding (C and E), the output matrix (reads O) and the final norm (ones)."""
        if name == "output_norm.weight":
            return np.ones(shape, dtype=np.float32)
        if name not in ("token_embd.weight", "output.weight"):
            return data
        out = np.empty_like(data)
        for start in range(0, shape[0], _EMBED_ROWS):
            rows = slice(start, min(start + _EMBED_ROWS, shape[0]))
            values = np.zeros((rows.stop - rows.start, shape[1]), dtype=np.float32)  # [n, H]
            if name == "token_embd.weight":
                values[:, self.space("C")] = 1.0
                values[:, self.space("E")] = self.embedding(rows)
            else:  # logit_t = _LOGIT <O, e_t> for the normed residual's O (about O / rms)
                values[:, self.space("O")] = self.embedding(rows) * _LOGIT * self._rms(4)
            out[rows] = values if qtype == Q.F32 else quantize(values, qtype)
        return out

    def _empty(self, part: str) -> np.ndarray:
        """Zeros of attention tensor ``part``'s shape (float)."""
        p = self.p
        q, kv = p.n_heads * p.head_dim, p.n_kv_heads * p.head_dim
        shapes = {"attn_norm.weight": (p.hidden,), "attn_q_norm.weight": (p.head_dim,),
                  "attn_k_norm.weight": (p.head_dim,), "attn_q.weight": (q, p.hidden),
                  "attn_k.weight": (kv, p.hidden), "attn_v.weight": (kv, p.hidden),
                  "attn_output.weight": (p.hidden, q)}
        return np.zeros(shapes[part], dtype=np.float32)

    def _from_constant(self, pattern: np.ndarray) -> np.ndarray:
        """``[D, H]`` rows of a projection giving ``pattern [D]`` (up to scale) from the constant C."""
        rows = np.zeros((len(pattern), self.p.hidden), dtype=np.float32)
        rows[:, self.space("C")] = pattern[:, None] / _C
        return rows

    @staticmethod
    def _pairs(real: np.ndarray, imag: np.ndarray, first: int, half: int) -> np.ndarray:
        """``[2 half]`` head vector with pairs ``first..`` set to ``real + i imag`` (NEOX: (f, f + half))."""
        out = np.zeros(2 * half, dtype=np.float64)
        out[first:first + len(real)] = real
        out[half + first:half + first + len(imag)] = imag
        return out

    def _offset_heads(self, part: str) -> np.ndarray:
        """Layer 0: q heads 0 and 1 (kv head 0) attend 1 and 2 positions back; values E -> P1, P2.

        k = a (real, pairs 0..n), q = a e^{-i m theta}: the score sum_f a_f^2 cos((Δ - m) theta_f) peaks at
        Δ = m; the norm weights scale it to _PREV_SCORE nats there."""
        D, half = self.p.head_dim, self.p.head_dim // 2
        n, _margin = _offset_pairs(self.theta, self.context)
        amp = np.full(n, 1 / math.sqrt(n))
        out = self._empty(part)
        if part == "attn_norm.weight":
            out[:] = 1.0
        elif part == "attn_q_norm.weight":  # |q| = sqrt(D) after the norm: score = weight * sqrt(D) * q.k
            out[:] = _PREV_SCORE / math.sqrt(D)
        elif part == "attn_k_norm.weight":
            out[:] = 1.0
        elif part == "attn_q.weight":
            for m in (1, 2):
                turn = amp * np.exp(-1j * m * self.theta[:n])
                out[(m - 1) * D:m * D] = self._from_constant(self._pairs(turn.real, turn.imag, 0, half))
        elif part == "attn_k.weight":
            out[:D] = self._from_constant(self._pairs(amp, np.zeros(n), 0, half))
        elif part == "attn_v.weight":  # v = e_t: E of the normed residual times its RMS
            self._put(out, np.arange(self.dim), self.space("E"), self._rms(1))
        elif part == "attn_output.weight":
            for m, target in ((1, "P1"), (2, "P2")):
                self._put(out, self.space(target), (m - 1) * D + np.arange(self.dim), 1.0)
        return out

    def _induction_heads(self, part: str) -> np.ndarray:
        """Layer 1: per kv head g, query head g * rep matches (E, P1) at i against (P1, P2) at j in the
        slow pairs (the current token's match weighs 2 _MATCH nats, the previous one's _MATCH), plus the
        recency fit in the fast pairs; values E -> O, the heads averaged.

        q and k are built in nats (q.k is the score); the norm weights undo the q/k norm's scaling."""
        p, D, half = self.p, self.p.head_dim, self.p.head_dim // 2
        rep, fc = p.n_heads // p.n_kv_heads, self.first_content
        cos_w, sin_w = _recency_fit(self.theta[:fc], self.context)
        amp = np.sqrt(np.hypot(cos_w, sin_w)) + 1e-9  # k's amplitude per recency pair; q = (c - i s) / amp
        q_pos = self._pairs(cos_w / amp, -sin_w / amp, 0, half)  # [D]
        k_pos = self._pairs(amp, np.zeros(fc), 0, half)  # [D]
        slot1, slot2 = self._slots()
        out = self._empty(part)
        if part == "attn_norm.weight":
            out[:] = 1.0
        elif part == "attn_q_norm.weight":  # after the norm |q| = sqrt(D) weight: give it |q| / sqrt(D)
            out[:] = math.sqrt(q_pos @ q_pos + 5 * _MATCH**2) / math.sqrt(D)  # codes weigh 2 M and M
        elif part == "attn_k_norm.weight":  # |k| (two unit codes), and the score's 1 / sqrt(D)
            out[:] = math.sqrt(k_pos @ k_pos + 2)
        unit = math.sqrt(self.n_codes)  # a code in E, P1, P2 is a unit code over sqrt(n_codes)
        for g in range(p.n_kv_heads):
            qh, kh = g * rep * D, g * D
            if part == "attn_q.weight":
                out[qh:qh + D] = self._from_constant(q_pos)
                self._put(out, qh + slot1, self.code_of("E", g), 2 * _MATCH * unit)
                self._put(out, qh + slot2, self.code_of("P1", g), _MATCH * unit)
            elif part == "attn_k.weight":
                out[kh:kh + D] = self._from_constant(k_pos)
                self._put(out, kh + slot1, self.code_of("P1", g), unit)
                self._put(out, kh + slot2, self.code_of("P2", g), unit)
            elif part == "attn_v.weight":  # v = e_t
                self._put(out, kh + np.arange(self.dim), self.space("E"), self._rms(3))
            elif part == "attn_output.weight":
                self._put(out, self.space("O"), qh + np.arange(self.dim), 1 / p.n_kv_heads)
        return out

    def _slots(self) -> tuple[np.ndarray, np.ndarray]:
        """The head dims of the current token's code and of the previous token's (``[code]`` each: the
        real parts of its pairs, then their imaginary parts), in the slow pairs."""
        half, k, fc = self.p.head_dim // 2, self.slot_pairs, self.first_content
        real = np.arange(fc, half)
        imag = real + half
        return np.concatenate([real[:k], imag[:k]]), np.concatenate([real[k:], imag[k:]])

    @staticmethod
    def _put(out: np.ndarray, rows: np.ndarray | slice, cols: np.ndarray | slice, value: float) -> None:
        """``out[rows[n], cols[n]] = value``: a scaled identity from ``cols`` to ``rows``."""
        rows = np.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows
        cols = np.arange(cols.start, cols.stop) if isinstance(cols, slice) else cols
        out[rows, cols] = value
