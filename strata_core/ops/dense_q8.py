"""``strata::q8_linear``: ``x @ W.T`` straight from a Q8_0 matrix, for the dense products of a decode step.

A decode token reads every dense weight once; dequantized to bf16 at load (``DenseWeights``) that is
2 bytes a value, where the GGUF's Q8_0 blocks are 1.0625. This op reads the Q8_0 values, nearly
halving the bytes a decode step reads for its dense products.

**Layout** (:class:`Q8Matrix`, built once from the GGUF bytes by :func:`repack_q8_0`): a GGUF Q8_0
block is a float16 scale ``d`` then 32 int8 codes ``q``, value ``d * q``. Repacked, the codes are
one contiguous int8 ``[N, K]`` matrix (so a row's codes are read with 16-byte loads) and the scales a
float16 ``[N, K/32]`` matrix (the same bits as the blocks': the values are exactly the reference
dequantization's, ``q.float() * d.float()``). Rows are independent, so the rows of several matrices
(q, k, v) concatenate into one (:meth:`Q8Matrix.cat`).

**Op**: ``q8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor``: ``x [M, K]`` times the matrix
transposed -> ``[M, N]`` in ``x.dtype``, accumulated in float32. The CPU kernel (the oracle)
dequantizes and calls :func:`strata_core.ops.matmul.linear` in float32.

**CUDA kernel** (Triton, for decode's small M): memory-bound, so each program reads ``BN`` rows of
codes as ``[BN, NB, 32]`` tiles (a row's ``NB * 32`` codes contiguous: 16-byte loads) with their
``[BN, NB]`` scales, and dots them with a row of x (read from the caches: x is small); a block's 32
products are summed, scaled, and accumulated per (row of W, block) in float32; the blocks are summed
once at the end. A program does this for ``MB`` rows of x one after the other (its W tile is read
again from the SM's cache); ``M > MB``: the x rows are tiled over programs, those of one W tile next
to each other (the L2 serves the repeated reads). No split-K, no atomics: deterministic. How many
rows a program takes and how big a step is (:class:`Q8Config`, :data:`DEFAULT_LAUNCH`) is chosen per shape so
that there are enough programs and bytes in flight to approach HBM bandwidth; tools/gemv_bench.py
times alternatives against cuBLAS's bf16 product. (llama.cpp's MMVQ, for comparison, takes one row a
block of 4 warps for one token and quantizes x to q8_1 for dp4a; here x stays in its dtype.)

Tolerance against the reference: float32 within a relative 1e-5 of the largest output (summation
order); bf16 / fp16 outputs within 1e-2 of it (one rounding of the output) (tests/test_dense_q8.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from torch import Tensor

from strata_core.ops.matmul import linear
from strata_core.ops.qdecode import HAS_TRITON, on_device
from strata_core.quant.bits import fields, reinterpret

__all__ = ["DEFAULT_LAUNCH", "DEFAULT_ROWS", "GEMV_MAX_ROWS", "Q8Config", "Q8Matrix", "Q8RowsConfig", "q8_bytes",
           "q8_linear", "repack_q8_0"]

QK = GGML_QUANT_SIZES[T.Q8_0][0]  # 32 values a block
_BLOCK_BYTES = GGML_QUANT_SIZES[T.Q8_0][1]  # 34: float16 d + 32 int8


@dataclass(frozen=True)
class Q8Matrix:
    """A Q8_0 matrix ``[N, K]`` repacked: int8 ``codes [N, K]`` and float16 ``scales [N, K/32]``."""

    codes: Tensor
    scales: Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``."""
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the codes and scales."""
        return self.codes.nbytes + self.scales.nbytes

    def to(self, device: torch.device | str) -> "Q8Matrix":
        """A copy on ``device``."""
        return Q8Matrix(self.codes.to(device), self.scales.to(device))

    def dequantize(self) -> Tensor:
        """The float32 values ``[N, K]``: ``codes * scales`` per block, as the GGUF reference computes them."""
        N, K = self.shape
        return (self.codes.view(N, K // QK, QK).float() * self.scales.float()[:, :, None]).view(N, K)

    @staticmethod
    def cat(parts: list["Q8Matrix"]) -> "Q8Matrix":
        """The matrices' rows one after another (every part has the same K)."""
        return Q8Matrix(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]))

    def split(self, rows: list[int]) -> list["Q8Matrix"]:
        """Views of consecutive row ranges of ``rows`` rows each (the inverse of :meth:`cat`)."""
        return [Q8Matrix(c, s) for c, s in zip(self.codes.split(rows), self.scales.split(rows))]


def q8_bytes(shape: tuple[int, int]) -> int:
    """Bytes of the :class:`Q8Matrix` of a ``shape`` Q8_0 matrix (the GGUF's bytes: 34 per 32 values)."""
    N, K = shape
    return N * K // QK * _BLOCK_BYTES


def repack_q8_0(raw: Tensor, shape: tuple[int, int]) -> Q8Matrix:
    """The :class:`Q8Matrix` of the Q8_0 bytes ``raw`` (uint8, any device) of a ``shape = (N, K)``
    matrix (torch order: N rows of K values)."""
    N, K = shape
    if K % QK:
        raise ValueError(f"a Q8_0 matrix has rows of whole 32-value blocks, got shape {tuple(shape)}")
    if raw.numel() != q8_bytes(shape):
        raise ValueError(f"Q8_0 {tuple(shape)} takes {q8_bytes(shape)} bytes, got {raw.numel()}")
    d, q = fields(raw.reshape(-1, _BLOCK_BYTES), 2, QK)  # [N*K/32, 2], [N*K/32, 32]
    scales = reinterpret(d, torch.float16).reshape(N, K // QK).clone()
    codes = q.contiguous().view(torch.int8).reshape(N, K)
    return Q8Matrix(codes, scales)


@dataclass(frozen=True)
class Q8Config:
    """How the CUDA kernel is launched (read at each launch: :data:`DEFAULT_LAUNCH`, or the ``config``
    argument of ``q8_linear_triton``, through which tools/gemv_bench.py times alternatives).

    ``tile``: codes a program reads per step, ``BN * NB * 32`` (``BN`` rows of W, ``NB`` blocks of
    each; what bounds its registers); ``bn``: rows of W a program takes (0: chosen from N so that about
    ``programs`` programs run, at most ``max_bn``, keeping a row's read per step long); ``max_mb``: rows
    of x a program takes (``MB``; more rows tile M over programs); ``warps``: num_warps. Defaults:
    reasoned for the H200 (132 SMs; sm_90 compile: 4 warps and an 8 KB step need no spills, so
    several programs and ~32 KB of reads are in flight on an SM), to be confirmed by tools/gemv_bench.py.
    """

    tile: int = 8192
    bn: int = 0
    programs: int = 1024
    max_bn: int = 16
    max_mb: int = 4
    warps: int = 4

    def __post_init__(self) -> None:
        for name in ("tile", "programs", "max_bn", "max_mb", "warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"Q8Config.{name}: {v} is not a power of two")
        if self.bn < 0 or self.bn & (self.bn - 1):
            raise ValueError(f"Q8Config.bn: {self.bn} is not 0 (auto) or a power of two")
        if self.tile < QK:
            raise ValueError(f"Q8Config.tile: {self.tile} is less than one block ({QK})")

    def launch(self, M: int, N: int, K: int) -> tuple[int, int, int]:
        """``(MB, BN, NB)`` for an ``[M, K] x [N, K]^T`` product."""
        mb = min(_pow2_at_least(M), self.max_mb)
        blocks = self.tile // QK  # blocks of W a step reads
        bn = self.bn or min(max(1, _pow2_at_most(N // self.programs)), self.max_bn)
        bn = min(bn, blocks)
        nb = max(1, min(_pow2_at_least(K // QK), blocks // bn))
        return mb, bn, nb


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _pow2_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n > 0 else 0


#: The launch configuration of the CUDA kernel (what ``strata::q8_linear`` launches with).
DEFAULT_LAUNCH = Q8Config()


#: ``Q8RowsConfig.mode``s: how a step's W tile meets the x rows on the tensor cores
ROWS_MODES = ("bf16", "deq", "i8")


@dataclass(frozen=True)
class Q8RowsConfig:
    """How the rows kernel (several rows of x, ``q8_rows_triton``) is launched.

    ``mode``: ``"bf16"``: each 32-value block's codes (exact in bf16) dotted with x's block on the tensor
    cores, the float32 result scaled by the block's scale (no rounding of W; x as given; float32 x: the
    exact "ieee" dot); ``"deq"``: the step's ``[BN, nb*32]`` tile dequantized to x's dtype (``codes *
    scale`` rounded to bf16, as the float copy is) and dotted once; ``"i8"``: x quantized per 32 values to
    int8 (``moe_q8.quantize_q8``), each block an int8 x int8 -> int32 dot, scaled by both scales (half
    precision x only). ``bm``: rows of x a program (the ``tl.dot`` tile, at least 16; more rows of x
    tile over programs, each reading W again); ``bn``: rows of W a program; ``nb``: blocks of 32 a step;
    ``programs``: split K so that about this many programs run (0: never split); the splits' float32
    partial sums are added in split order by a second launch. ``warps``/``stages``: num_warps and
    num_stages. Nothing depends on M but the number of x tiles, so a row's result is the same bits
    whatever the other rows and however many (tests/test_dense_q8.py).
    """

    mode: str = "bf16"
    bm: int = 16
    bn: int = 64
    nb: int = 4
    programs: int = 256
    warps: int = 4
    stages: int = 3

    def __post_init__(self) -> None:
        if self.mode not in ROWS_MODES:
            raise ValueError(f"Q8RowsConfig.mode: {self.mode!r} is not one of {ROWS_MODES}")
        if self.stages < 1:
            raise ValueError(f"Q8RowsConfig.stages: {self.stages} < 1")
        for name in ("bm", "bn", "nb", "warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"Q8RowsConfig.{name}: {v} is not a power of two")
        if self.bm < 16 or self.bn < 16:
            raise ValueError(f"Q8RowsConfig: bm and bn are tl.dot tiles, at least 16 (got {self.bm}, {self.bn})")
        if self.programs < 0:
            raise ValueError(f"Q8RowsConfig.programs: {self.programs} < 0")

    def launch(self, N: int, K: int) -> tuple[int, int]:
        """``(splits, blocks)`` for an ``[N, K]`` matrix: K cut into ``splits`` ranges of ``blocks`` blocks
        of 32 (a multiple of ``nb``; the last range may be shorter). M plays no part."""
        kb = K // QK
        n_tiles = -(-N // self.bn)
        splits = 1
        if self.programs:
            splits = min(_pow2_at_most(max(1, self.programs // n_tiles)), _pow2_at_least(-(-kb // self.nb)))
        blocks = -(-kb // splits)
        blocks = -(-blocks // self.nb) * self.nb
        return -(-kb // blocks), blocks


#: The rows kernel's launch (what ``strata::q8_linear`` launches for more than :data:`GEMV_MAX_ROWS` rows).
DEFAULT_ROWS = Q8RowsConfig()
#: Most rows of x the gemv kernel takes on CUDA; more take the rows kernel.
GEMV_MAX_ROWS = 1

_SCHEMA = "(Tensor x, Tensor codes, Tensor scales) -> Tensor"


def _check(x: Tensor, codes: Tensor, scales: Tensor) -> None:
    if x.dim() != 2 or codes.dim() != 2 or scales.dim() != 2:
        raise ValueError(f"q8_linear takes x [M, K], codes [N, K], scales [N, K/32]; got {tuple(x.shape)}, "
                         f"{tuple(codes.shape)}, {tuple(scales.shape)}")
    N, K = codes.shape
    if x.shape[1] != K or K % QK or tuple(scales.shape) != (N, K // QK):
        raise ValueError(f"q8_linear: x {tuple(x.shape)}, codes {tuple(codes.shape)} and scales "
                         f"{tuple(scales.shape)} do not make one [N, K] Q8_0 matrix with K = x's width")
    if codes.dtype != torch.int8 or scales.dtype != torch.float16:
        raise ValueError(f"q8_linear: codes must be int8 and scales float16, got {codes.dtype}, {scales.dtype}")


def _reference(x: Tensor, codes: Tensor, scales: Tensor) -> Tensor:
    """The oracle: dequantize to float32, then the batch-invariant ``linear`` in float32."""
    _check(x, codes, scales)
    return linear(x.float(), Q8Matrix(codes, scales).dequantize()).to(x.dtype)  # [M, N]


def _fake(x: Tensor, codes: Tensor, scales: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], codes.shape[0]))


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _q8_gemv_kernel(x, codes, scales, out, M, N, K, m_tiles, stride_x, stride_o,
                        MB: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, EVEN_K: tl.constexpr):
        """Program i: rows ``[n*BN, (n+1)*BN)`` of W (``n = i // m_tiles``) times rows ``[m*MB, (m+1)*MB)``
        of x (``m = i % m_tiles``), one x row after the other (the W tile's second read comes from the
        SM's cache); a step reads ``[BN, NB, 32]`` codes (``NB`` blocks of each W row)."""
        pid = tl.program_id(0)
        pm = pid % m_tiles
        pn = pid // m_tiles
        rows = pn * BN + tl.arange(0, BN)
        keep = rows < N
        rows = tl.where(keep, rows, 0).to(tl.int64)  # out-of-range rows read row 0 and are not stored
        KB = K // 32
        j = tl.arange(0, NB)
        w = tl.arange(0, 32)
        q_row = codes + rows[:, None, None] * K + w[None, None, :]  # [BN, 1, 32]
        s_row = scales + rows[:, None] * KB  # [BN, 1]
        for i in tl.static_range(MB):
            m = pm * MB + i
            x_row = x + m.to(tl.int64) * stride_x + w[None, :]  # [1, 32]
            acc = tl.zeros([BN, NB], dtype=tl.float32)
            if m < M:
                for kb0 in range(0, KB, NB):
                    blk = kb0 + j  # [NB]
                    if EVEN_K:
                        q = tl.load(q_row + blk[None, :, None] * 32)  # [BN, NB, 32] int8
                        s = tl.load(s_row + blk[None, :])  # [BN, NB] float16
                        xv = tl.load(x_row + blk[:, None] * 32)  # [NB, 32] (2-D: its layout follows q's)
                    else:
                        valid = blk < KB
                        q = tl.load(q_row + blk[None, :, None] * 32, mask=valid[None, :, None], other=0)
                        s = tl.load(s_row + blk[None, :], mask=valid[None, :], other=0.0)
                        xv = tl.load(x_row + blk[:, None] * 32, mask=valid[:, None], other=0.0)
                    p = tl.sum(q.to(tl.float32) * xv.to(tl.float32)[None, :, :], axis=2)  # [BN, NB]: 32 products a block
                    acc += p * s.to(tl.float32)
                tl.store(out + m.to(tl.int64) * stride_o + rows, tl.sum(acc, axis=1).to(out.dtype.element_ty),
                         mask=keep)

    @triton.jit
    def _q8_rows_kernel(x, xd, codes, scales, out, M, N, K, stride_x, stride_o, stride_s, BLOCKS,
                        BM: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, MODE: tl.constexpr,
                        EVEN: tl.constexpr, IEEE: tl.constexpr):
        """Program (m, n, s): rows ``[n*BN, (n+1)*BN)`` of W times rows ``[m*BM, (m+1)*BM)`` of x over the
        blocks ``[s*BLOCKS, (s+1)*BLOCKS)`` of K (``out``: the float32 partial sums ``[S, M, N]``
        where K is split, at ``s * stride_s``); a step reads ``NB`` blocks of 32 codes of each W row once
        for all BM x rows. MODE 0 ("bf16"): a block's codes dotted with x's, scaled by W's scale; 1
        ("deq"): the step's tile dequantized to x's dtype, one dot; 2 ("i8"): x's int8 codes (``xd``:
        their float32 scales ``[M, K/32]``) dotted with the block's codes in int32, scaled by both."""
        pm = tl.program_id(0)  # the x tiles of one W tile run side by side: its second read hits the L2
        pn = tl.program_id(1)
        ps = tl.program_id(2)
        rows = pn * BN + tl.arange(0, BN)
        keep = rows < N
        rows = tl.where(keep, rows, 0).to(tl.int64)  # out-of-range rows read row 0 and are not stored
        xm = pm * BM + tl.arange(0, BM)
        keep_m = xm < M
        xm = tl.where(keep_m, xm, 0).to(tl.int64)  # out-of-range x rows read as 0, not stored
        KB = K // 32
        lo = ps * BLOCKS
        hi = tl.minimum(lo + BLOCKS, KB)
        w = tl.arange(0, 32)
        q_row = codes + rows[:, None] * K + w[None, :]  # [BN, 32]
        x_base = x + xm[:, None] * stride_x  # [BM, 1]
        x_row = x_base + w[None, :]  # [BM, 32]
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for kb0 in range(lo, hi, NB):
            if MODE == 1:
                blk = kb0 + tl.arange(0, NB)
                kt = tl.arange(0, NB * 32)
                if EVEN:
                    q = tl.load(q_row[:, None, :] + blk[None, :, None] * 32)  # [BN, NB, 32] int8
                    s = tl.load(scales + rows[:, None] * KB + blk[None, :])  # [BN, NB]
                    xv = tl.load(x_base + kb0 * 32 + kt[None, :], mask=keep_m[:, None], other=0.0)
                else:
                    valid = blk < hi
                    q = tl.load(q_row[:, None, :] + blk[None, :, None] * 32, mask=valid[None, :, None], other=0)
                    s = tl.load(scales + rows[:, None] * KB + blk[None, :], mask=valid[None, :], other=0.0)
                    xv = tl.load(x_base + kb0 * 32 + kt[None, :],
                                 mask=keep_m[:, None] & (kb0 * 32 + kt < hi * 32)[None, :], other=0.0)
                wt = tl.reshape((q.to(tl.float32) * s.to(tl.float32)[:, :, None]).to(xv.dtype), (BN, NB * 32))
                if IEEE:
                    acc = tl.dot(xv, tl.trans(wt), acc, input_precision="ieee")
                else:
                    acc = tl.dot(xv, tl.trans(wt), acc)
            else:
                for j in tl.static_range(NB):
                    kb = kb0 + j
                    if EVEN:
                        q = tl.load(q_row + kb * 32)  # [BN, 32] int8
                        s = tl.load(scales + rows * KB + kb).to(tl.float32)  # [BN]
                        xv = tl.load(x_row + kb * 32, mask=keep_m[:, None], other=0)  # [BM, 32]
                    else:
                        valid = (kb + tl.zeros([BN], dtype=tl.int32)) < hi  # [BN]: the block is in range
                        q = tl.load(q_row + kb * 32, mask=valid[:, None], other=0)
                        s = tl.load(scales + rows * KB + kb, mask=valid, other=0.0).to(tl.float32)
                        xv = tl.load(x_row + kb * 32, mask=(keep_m & (kb + tl.zeros([BM], dtype=tl.int32) < hi))[:, None],
                                     other=0)
                    if MODE == 2:
                        dx = tl.load(xd + xm * KB + kb, mask=keep_m, other=0.0)  # [BM] float32
                        d = tl.dot(xv, tl.trans(q), out_dtype=tl.int32)  # [BM, BN] exact
                        acc += d.to(tl.float32) * (dx[:, None] * s[None, :])
                    else:
                        if IEEE:
                            d = tl.dot(xv, tl.trans(q.to(xv.dtype)), input_precision="ieee")
                        else:
                            d = tl.dot(xv, tl.trans(q.to(xv.dtype)))  # [BM, BN] float32
                        acc += d * s[None, :]
        at = out + ps.to(tl.int64) * stride_s + xm[:, None] * stride_o + rows[None, :]
        tl.store(at, acc.to(out.dtype.element_ty), mask=keep_m[:, None] & keep[None, :])

    @triton.jit
    def _sum_splits_kernel(part, out, MN, S: tl.constexpr, B: tl.constexpr):
        """``out[i] = part[0, i] + part[1, i] + ...`` (``S`` float32 partial sums, in that order)."""
        i = tl.program_id(0) * B + tl.arange(0, B)
        keep = i < MN
        acc = tl.load(part + i, mask=keep, other=0.0)
        for s in tl.static_range(1, S):
            acc += tl.load(part + s * MN + i, mask=keep, other=0.0)
        tl.store(out + i, acc.to(out.dtype.element_ty), mask=keep)

    def _launch_operands(x: Tensor, codes: Tensor, scales: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """A Triton launch's ``(x, codes, scales, out)``: the arguments checked, x's rows unit-stride, the
        matrix contiguous, and the ``[M, N]`` output allocated in x's dtype."""
        _check(x, codes, scales)
        if x.stride(1) != 1:
            x = x.contiguous()
        return x, codes.contiguous(), scales.contiguous(), x.new_empty((x.shape[0], codes.shape[0]))

    def q8_rows_triton(x: Tensor, codes: Tensor, scales: Tensor, config: Q8RowsConfig = DEFAULT_ROWS) -> Tensor:
        """The rows kernel of ``q8_linear`` (several rows of x: each W tile read once for ``config.bm``
        rows) on the tensors' device (CUDA; CPU tensors under ``TRITON_INTERPRET=1``)."""
        if config.mode == "i8" and x.dtype == torch.float32:
            raise ValueError("q8_rows_triton: mode 'i8' quantizes x, which takes bf16 / fp16 x, not float32")
        x, codes, scales, out = _launch_operands(x, codes, scales)
        (M, K), N = x.shape, codes.shape[0]
        if M == 0 or N == 0:
            return out
        splits, blocks = config.launch(N, K)
        xd = scales  # unread unless i8
        if config.mode == "i8":
            from strata_core.ops.moe_q8 import quantize_q8  # imports the MoE kernels: only when asked for

            words, xd, _ = quantize_q8(x)
            x = words.view(torch.int8)
        part = out if splits == 1 else torch.empty((splits, M, N), dtype=torch.float32, device=out.device)
        even = (K // QK) % blocks == 0 and blocks % config.nb == 0
        with on_device(out.device):
            _q8_rows_kernel[(triton.cdiv(M, config.bm), triton.cdiv(N, config.bn), splits)](
                x, xd, codes, scales, part, M, N, K, x.stride(0), N, M * N, blocks,
                BM=config.bm, BN=config.bn, NB=config.nb, MODE=ROWS_MODES.index(config.mode), EVEN=even,
                IEEE=x.dtype == torch.float32, num_warps=config.warps, num_stages=config.stages)
            if splits > 1:
                _sum_splits_kernel[(triton.cdiv(M * N, 1024),)](part, out, M * N, S=splits, B=1024, num_warps=4)
        return out

    def q8_linear_triton(x: Tensor, codes: Tensor, scales: Tensor, config: Q8Config = DEFAULT_LAUNCH) -> Tensor:
        """The Triton kernel of ``q8_linear`` on the tensors' device (CUDA; CPU tensors under
        ``TRITON_INTERPRET=1``), launched as ``config`` says."""
        x, codes, scales, out = _launch_operands(x, codes, scales)
        (M, K), N = x.shape, codes.shape[0]
        if M == 0 or N == 0:
            return out
        mb, bn, nb = config.launch(M, N, K)
        m_tiles = triton.cdiv(M, mb)
        with on_device(x.device):  # Triton launches on the current device
            _q8_gemv_kernel[(m_tiles * triton.cdiv(N, bn),)](
                x, codes, scales, out, M, N, K, m_tiles, x.stride(0), out.stride(0),
                MB=mb, BN=bn, NB=nb, EVEN_K=(K // QK) % nb == 0, num_warps=config.warps)
        return out


if HAS_TRITON:
    def q8_linear_cuda(x: Tensor, codes: Tensor, scales: Tensor) -> Tensor:
        """``q8_linear`` on CUDA: the gemv kernel for at most :data:`GEMV_MAX_ROWS` rows of x, the rows
        kernel (:data:`DEFAULT_ROWS`; float32 x never quantized) beyond. The choice reads x's shape alone."""
        if x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS:
            return q8_linear_triton(x, codes, scales)
        config = DEFAULT_ROWS
        if config.mode == "i8" and x.dtype == torch.float32:
            config = dataclasses.replace(config, mode="bf16")
        return q8_rows_triton(x, codes, scales, config)


q8_linear = torch.library.custom_op("strata::q8_linear", _reference, mutates_args=(), schema=_SCHEMA)
q8_linear.register_fake(_fake)
if HAS_TRITON:
    q8_linear.register_kernel("cuda")(q8_linear_cuda)
