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

from dataclasses import dataclass

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from torch import Tensor

from strata_core.ops.matmul import linear
from strata_core.ops.qdecode import HAS_TRITON, on_device
from strata_core.quant.bits import fields, reinterpret

__all__ = ["DEFAULT_LAUNCH", "Q8Config", "Q8Matrix", "q8_bytes", "q8_linear", "repack_q8_0"]

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

    def q8_linear_triton(x: Tensor, codes: Tensor, scales: Tensor, config: Q8Config = DEFAULT_LAUNCH) -> Tensor:
        """The Triton kernel of ``q8_linear`` on the tensors' device (CUDA; CPU tensors under
        ``TRITON_INTERPRET=1``), launched as ``config`` says."""
        _check(x, codes, scales)
        if x.stride(1) != 1:
            x = x.contiguous()
        codes, scales = codes.contiguous(), scales.contiguous()
        M, K = x.shape
        N = codes.shape[0]
        out = x.new_empty((M, N))
        if M == 0 or N == 0:
            return out
        mb, bn, nb = config.launch(M, N, K)
        m_tiles = triton.cdiv(M, mb)
        with on_device(x.device):  # Triton launches on the current device
            _q8_gemv_kernel[(m_tiles * triton.cdiv(N, bn),)](
                x, codes, scales, out, M, N, K, m_tiles, x.stride(0), out.stride(0),
                MB=mb, BN=bn, NB=nb, EVEN_K=(K // QK) % nb == 0, num_warps=config.warps)
        return out


q8_linear = torch.library.custom_op("strata::q8_linear", _reference, mutates_args=(), schema=_SCHEMA)
q8_linear.register_fake(_fake)
if HAS_TRITON:
    q8_linear.register_kernel("cuda")(q8_linear_triton)
