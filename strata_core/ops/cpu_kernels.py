"""``strata::qlinear_grouped``: quantized products on the CPU that read GGML blocks in place; and
``strata::dequantize_blocks``, the same decoders writing the blocks' values (``strata::dequantize`` on
the CPU, for the formats they cover: bit for bit the torch reference's values, many times faster).

``qlinear_grouped(x [N, K] float32, weights: list of uint8 [out * row_bytes], counts: list[int],
qtype, out) -> [N, out] float32``: the rows of ``x`` are cut into consecutive segments, segment i
(``counts[i]`` rows) multiplied by ``weights[i]`` transposed (``out`` rows of ``K`` values in
``qtype`` blocks). One call computes every routed expert of a layer (its pairs sorted by expert) or
one weight each pair, threaded over (segment, 16 rows) on ``torch.get_num_threads()`` threads, each
item claimed by the next free thread (``strata::cpu_kernel_threads()`` says how many threads the
calling thread's products run).
``qlinear_slots`` is the same product with the weights found by row of one buffer (a cache's slots)
per (token, k) pair, grouped by slot inside the op: a layer's routed experts without a tensor per
expert on the host. ``slot_ffn_cpu`` is a whole SiLU-gated expert FFN that way (gate and up products,
``silu_mul_cpu``, the down product) in one call; ``silu_mul_cpu`` is the activation every CPU expert
path applies to float32 (experts/ffn.py), so each row has the same bits whichever path computes it.

The kernel (csrc/cpu_experts.cpp) has two kinds of body. The float bodies (generic, AVX2, AVX-512)
decode each block once into float32, the values of the torch reference (strata_core/quant), and
multiply it into up to 8 tokens lane-wise (a multiply and an add, each rounded: compiled without FP
contraction, so no compiler fuses some and not others); they give the same bits as one another.
Tolerance against the reference dequantize + matmul: float32 within a relative 1e-5 (summation order),
as the CUDA kernels.

Where the CPU has AVX-512 VNNI (instruction set 3, "AVX-512 VNNI"), the formats of
:data:`CPU_INT8_TYPES` take an int8 body instead, as llama.cpp's CPU backend does: each call quantizes
its rows of ``x`` once, every 32 values to int8 codes with one float32 scale (``max |v| / 127``,
rounded half away from zero), and dots the blocks' codes with them 64 at a time (``vpdpbusd``: unsigned
weight codes times signed activation codes, four products summed into an int32 lane), each lane scaled
in float32 by its weight and activation scales; MXFP4's and IQ4_XS's codes go through their 16-value
tables (a byte shuffle) to signed integers; offsets (Q4_0's 8, Q6_K's 32, Q8_0's signed codes, the
tables' 16 and 128 that make their values unsigned) come out exactly in integers, Q4_K / Q5_K's mins in
float32 against the sum of the values themselves. It
reads each weight in about one instruction where decoding it to float32 takes several. The CUDA q8
decode MoE kernels (ops/moe_q8_kernels.py) quantize activations the same way (per 32 values, the same
scale and rounding), so these results keep within the tolerance those kernels are held to: a relative
(Frobenius) 2e-2 of the reference (tests/test_moe_q8.py, tests/test_cpu_kernels.py), not the float32
one; :func:`int8_activations` says which formats run it (every format with a CPU kernel).

Either way a row's result does not depend on the other rows, the tile or the threads (each row is
quantized by itself), so every CPU expert path computes the same bits; the body is chosen at run time
(``strata::cpu_kernel_isa``; ``strata::cpu_kernel_limit_isa`` caps it, for tests: 2 gives the float
AVX-512 body).

``strata::attention_cpu`` (csrc/cpu_attention.cpp) is the CPU's causal GQA attention over float32 keys
and values, each row's arithmetic fixed by its own query and visible keys (its doc says the order), so
a token's output does not depend on the chunk, the batch, the cache capacity or the threads.

``strata::linear_cpu`` (csrc/cpu_linear.cpp) is the CPU's float32 weight product with the same property
(ops/matmul.py ``linear``).

``strata::rms_norm_cpu``, ``strata::norm_rope_cpu``, ``strata::route_cpu`` and ``strata::combine_cpu``
(csrc/cpu_layer.cpp) are the small ops of a float32 layer on the CPU (the RMSNorm, the q/k norm with
RoPE, the router's softmax / top-k / renormalisation, the weighted sum of the expert rows with the
residual), each one call where the torch formulas take several, each row's arithmetic fixed by its own
values: the forward's CPU path calls them wherever it would call those formulas (model/ops.py,
model/transformer.py, ops/combine.py), so every CPU path of a forward gives the same bits.
``strata::add_rms_norm_cpu`` (a residual add and the next norm) and ``strata::qkv_rope_cpu`` (the q/k
norm and RoPE of a q/k/v product's rows with the K/V rows written into the cache's pools) join a few
of them into one call, each output the bits of the ops it joins: fewer calls between the layer's large
kernels, where each small call runs on caches those kernels have just emptied. ``strata::route_slot_ffn_cpu``
is a layer's routed experts held in a cache's slots in one call: the router's product, ``route_cpu``, the
slot lookup and usage count, ``slot_ffn_cpu`` and ``combine_cpu``.

The extension is compiled on first use with ``torch.utils.cpp_extension.load`` into torch's
extension cache (``TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``; rebuilt when the source
changes). Without a compiler, or with ``STRATA_CPU_KERNELS=0``, :func:`cpu_kernels` is False and
callers use the reference (one warning).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from torch import Tensor

from strata_core.ops.cpu_fakes import register_fakes

__all__ = ["CPU_INT8_TYPES", "CPU_KERNEL_TYPES", "INT8_ISA", "ISA_NAMES", "STALE_LOCK_S", "add_rms_norm_cpu",
           "attention_cpu", "clear_stale_lock", "combine_cpu", "cpu_kernels", "dequantize_blocks", "has_cpu_kernel",
           "int8_activations", "linear_cpu", "norm_rope_cpu", "qkv_rope_cpu", "qlinear_grouped", "qlinear_slots",
           "rms_norm_cpu", "route_cpu", "route_slot_ffn_cpu", "silu_mul_cpu", "slot_ffn_cpu"]

log = logging.getLogger(__name__)

#: The block formats with a CPU kernel; the others run the torch reference.
CPU_KERNEL_TYPES = frozenset({T.Q4_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS, T.MXFP4})
#: The block formats with an int8 body (int8 activations; run where the CPU has AVX-512 VNNI): every one
CPU_INT8_TYPES = CPU_KERNEL_TYPES
#: ``strata::cpu_kernel_isa`` of the int8 body
INT8_ISA = 3

_SOURCES = [Path(__file__).parent / "csrc" / name
            for name in ("cpu_experts.cpp", "cpu_attention.cpp", "cpu_linear.cpp", "cpu_layer.cpp")]
#: The instruction sets by ``strata::cpu_kernel_isa``
ISA_NAMES = ("generic", "AVX2", "AVX-512", "AVX-512 VNNI")
_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]


def _extension_name() -> str:
    """The extension's name, with a digest of its sources and flags: each version builds in a directory of
    its own, so checkouts of other versions (worktrees, an upgrade) never load or rebuild each other's."""
    import hashlib

    digest = hashlib.sha256(" ".join(_CFLAGS).encode())
    for source in _SOURCES:
        digest.update(source.read_bytes())
    for header in sorted(_SOURCES[0].parent.glob("*.h")):
        digest.update(header.read_bytes())
    return f"strata_cpu_kernels_{digest.hexdigest()[:12]}"


#: A build lock older than this is a killed build's (a build takes a minute or two): torch's loader would
#: wait on it forever, without a word
STALE_LOCK_S = 15 * 60


def clear_stale_lock(build_dir: str | os.PathLike[str], max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove ``build_dir``'s ``lock`` where it is older than ``max_age_s`` (logged); whether one was removed."""
    import time

    lock = Path(build_dir) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age_s:
        return False
    log.warning("CPU kernels: removing %s, left %.0f min ago by a build that did not finish", lock, age / 60)
    lock.unlink(missing_ok=True)
    return True


@functools.cache
def cpu_kernels() -> bool:
    """Whether the CPU kernels are loaded (compiled on the first call); logs the instruction set and
    the thread count, or warns once why the reference is used instead."""
    if os.environ.get("STRATA_CPU_KERNELS", "1") == "0":
        log.info("CPU expert kernels off (STRATA_CPU_KERNELS=0): the torch reference computes CPU experts")
        return False
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        name = _extension_name()
        build_dir = Path(_get_build_directory(name, verbose=False))
        clear_stale_lock(build_dir)
        if not (build_dir / f"{name}.so").exists():
            log.info("CPU kernels: compiling them into %s (the first run of these sources: a minute or two)",
                     build_dir)
        load(name=name, sources=[str(source) for source in _SOURCES], extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
             is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, no ninja, a failed build: the reference still works
        log.warning("CPU expert kernels unavailable (%s: %s): the torch reference computes CPU experts",
                    type(exc).__name__, str(exc).strip().splitlines()[-1] if str(exc).strip() else "")
        return False
    register_fakes()
    log.info("CPU expert kernels: %s, %d threads", ISA_NAMES[torch.ops.strata.cpu_kernel_isa()], torch.get_num_threads())
    return True


def has_cpu_kernel(qtypes: Sequence[int], shapes: Sequence[Sequence[int]]) -> bool:
    """Whether the CPU kernels are loaded and cover matrices of ``qtypes`` and ``shapes`` (``(out, in)``
    each, rows of whole blocks)."""
    return all(int(q) in CPU_KERNEL_TYPES and shape[1] % GGML_QUANT_SIZES[T(int(q))][0] == 0
               for q, shape in zip(qtypes, shapes)) and cpu_kernels()


def int8_activations(qtypes: Sequence[int]) -> bool:
    """Whether products of any of ``qtypes`` quantize their activations to int8 here (the kernels loaded,
    the int8 body chosen, a format it covers): results within the CUDA q8 kernels' tolerance of the
    reference (module doc) rather than float32's."""
    return (any(int(q) in CPU_INT8_TYPES for q in qtypes) and cpu_kernels()
            and torch.ops.strata.cpu_kernel_isa() >= INT8_ISA)


def qlinear_grouped(x: Tensor, weights: list[Tensor], counts: list[int], qtype: int, out: int) -> Tensor:
    """``[N, out]`` float32: segment i of ``x`` (its next ``counts[i]`` rows) times ``weights[i]``
    (``out`` rows of ``x.shape[1]`` values in ``qtype`` blocks, contiguous uint8) transposed.
    Needs :func:`cpu_kernels`. Arguments that do not fit are a ValueError naming the mismatch (checked
    here: an exception thrown inside the extension is not safe to unwind on every toolchain)."""
    _check(x, weights, counts, int(qtype), out)
    return torch.ops.strata.qlinear_grouped(x.float().contiguous(), [w.contiguous() for w in weights],
                                            counts, int(qtype), out)


def qlinear_slots(x: Tensor, rep: int, buffer: Tensor, slot: Tensor, offsets: Sequence[int], qtype: int,
                  out: int) -> Tensor:
    """``[P, len(offsets) * out]`` float32 for the ``P = slot.numel()`` pairs: pair p is row ``p // rep`` of
    ``x [P / rep, K]`` times the matrix at byte ``offsets[m]`` of row ``slot[p]`` of ``buffer`` (uint8
    ``[S, stride]``, ``out`` rows of K values in ``qtype`` blocks) transposed, in columns
    ``[m * out, (m + 1) * out)``; each row has the bits ``qlinear_grouped`` gives it. Needs :func:`cpu_kernels`;
    arguments that do not fit are a ValueError (checked here, as for ``qlinear_grouped``)."""
    _check_slots(x, rep, buffer, slot, offsets, int(qtype), out)
    return torch.ops.strata.qlinear_slots(x.float().contiguous(), rep, buffer, slot, list(offsets), int(qtype), out)


def slot_ffn_cpu(x: Tensor, rep: int, buffer: Tensor, slot: Tensor, offsets: Sequence[int], qtypes: Sequence[int],
                 ffn_dim: int) -> Tensor:
    """``[P, H]`` float32 for the ``P = slot.numel()`` pairs: pair p is row ``p // rep`` of ``x [P / rep, H]``
    through the expert packed in row ``slot[p]`` of ``buffer``, its gate, up and down matrices (``ffn_dim`` x
    H, ``ffn_dim`` x H, H x ``ffn_dim`` in ``qtypes``) at byte ``offsets``: ``down(silu(gate x) * up x)``, the
    bits of ``qlinear_slots`` for gate and up, ``silu_mul_cpu``, ``qlinear_slots`` for down. Needs
    :func:`cpu_kernels`; arguments that do not fit are a ValueError (checked here, as for ``qlinear_slots``)."""
    x = x.float().contiguous()
    H = x.shape[1]
    _check_pairs("slot_ffn_cpu", x, rep, buffer, slot)
    for name, off, qtype, K, out in (("gate", offsets[0], qtypes[0], H, ffn_dim),
                                     ("up", offsets[1], qtypes[1], H, ffn_dim),
                                     ("down", offsets[2], qtypes[2], ffn_dim, H)):
        _check_matrices(f"slot_ffn_cpu ({name})", K, buffer, [off], int(qtype), out)
    return torch.ops.strata.slot_ffn_cpu(x, rep, buffer, slot, [int(o) for o in offsets], [int(q) for q in qtypes],
                                         ffn_dim)


def route_slot_ffn_cpu(x: Tensor, router: Tensor, k: int, norm: bool, scale: float, min_sum: float, slots: Tensor,
                       counts: Tensor, buffer: Tensor, offsets: Sequence[int], qtypes: Sequence[int],
                       ffn_dim: int, check_slots: bool = True) -> tuple[Tensor, Tensor]:
    """``(out [T, H] float32, ids [T, k] int64)``: the routed experts of normed float32 rows ``x [T, H]`` in one
    call. The router's product ``x @ router.T`` (``linear_cpu``), ``route_cpu``'s ids and weights of it, pair
    p's expert in row ``slots[ids[p]]`` of ``buffer`` (int64 ``slots [E]``) with ``counts[ids[p]] += 1`` (int64
    ``[E]``, in place), ``slot_ffn_cpu`` of the pairs and ``combine_cpu`` of their rows: the bits of those ops
    one after another. Needs :func:`cpu_kernels`; matrices that do not fit ``buffer``'s rows and a slot outside
    its rows are a ValueError before anything is counted (checked here, as for ``slot_ffn_cpu``), the slots
    unless ``check_slots`` is False: the caller vouches for them (a cache's slots of a layer it holds whole)."""
    _ffn_fits("route_slot_ffn_cpu", x.shape[1], buffer.shape[1], tuple(offsets), tuple(qtypes), ffn_dim)
    if check_slots:
        _check_ids("route_slot_ffn_cpu", "an expert's slot", slots, buffer.shape[0], "rows of the buffer")
    return torch.ops.strata.route_slot_ffn_cpu(x, router, k, norm, scale, min_sum, slots, counts, buffer,
                                               list(offsets), list(qtypes), ffn_dim)


def silu_mul_cpu(g: Tensor, u: Tensor) -> Tensor:
    """``silu(g) * u`` of float32 CPU tensors of one shape, ``silu(g) = g / (1 + exp(-g))`` lane-wise
    (csrc/cpu_experts.cpp): each element's bits its own. Needs :func:`cpu_kernels`."""
    return torch.ops.strata.silu_mul_cpu(g, u)


def attention_cpu(q: Tensor, keys: Tensor, values: Tensor, positions: Tensor, window: int | None = None,
                  sinks: Tensor | None = None, rows: Tensor | None = None, check_rows: bool = True) -> Tensor:
    """``[T, nh*D]`` float32: causal GQA attention of ``q [T, nh, D]`` at ``positions [T]`` over ``keys`` /
    ``values [S, nkv, D]`` (key s visible when ``s <= position``, and ``position - s < window`` with a
    window), ``sinks [nh]`` joining each softmax's denominator only; float32 CPU tensors. With ``rows``
    (int64 ``[S]``) key s is row ``rows[s]`` of ``keys`` / ``values [N, nkv, D]``: a paged cache's pool read
    in place, the same bits as its rows gathered first. Needs :func:`cpu_kernels`; a row id outside ``keys``
    is a ValueError (checked here, as for ``qlinear_grouped``), unless ``check_rows`` is False: the caller
    vouches for them (a KV cache's row ids into its own pool), and no value is read back per call."""
    if check_rows and rows is not None:
        _check_ids("attention_cpu", "a row id", rows, keys.shape[0], "rows of keys")
    return torch.ops.strata.attention_cpu(q.contiguous(), keys.contiguous(), values.contiguous(),
                                          positions.to(torch.long), window or 0, sinks, rows)


def linear_cpu(x: Tensor, weight: Tensor) -> Tensor:
    """``x [M, K] @ weight.T`` (``weight [N, K]``), float32 CPU tensors: each output a 16-lane dot product
    summed pairwise, so a row's bits do not depend on M, the threads or the instruction set (csrc/cpu_linear.cpp).
    Needs :func:`cpu_kernels`."""
    return torch.ops.strata.linear_cpu(x.contiguous(), weight.contiguous())


def rms_norm_cpu(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of float32 ``x [..., D]`` over its last dim with ``weight [D]`` (csrc/cpu_layer.cpp: the
    formula of model/ops.py ``rms_norm``, the squares summed in 16 lanes). Needs :func:`cpu_kernels`."""
    return torch.ops.strata.rms_norm_cpu(x, weight, eps)


def norm_rope_cpu(x: Tensor, weight: Tensor | None, eps: float, positions: Tensor, inv_freq: Tensor,
                  mscale: float = 1.0) -> Tensor:
    """``[T, heads, D]`` float32: ``x [T, heads, D]`` (a view whose last dim is contiguous is read in place)
    RMS-normed per head with ``weight [D]`` (None: not normed), then NEOX-rotated at ``positions [T]`` by the
    angles ``position * inv_freq [D / 2]`` (tables times ``mscale``): model/ops.py's ``rms_norm``,
    ``rope_cos_sin`` and ``apply_rope`` in one call. Needs :func:`cpu_kernels`."""
    return torch.ops.strata.norm_rope_cpu(x, weight, eps, positions.to(torch.long), inv_freq, mscale)


def qkv_rope_cpu(qkv: Tensor, q_weight: Tensor | None, k_weight: Tensor | None, eps: float, positions: Tensor,
                 inv_freq: Tensor, mscale: float, n_heads: int, n_kv_heads: int, keys: Tensor, values: Tensor,
                 row_ids: Tensor, check_rows: bool = True) -> Tensor:
    """Queries ``[T, nh, D]`` float32 of a q/k/v product's rows ``qkv [T, (nh + 2 nkv) D]`` (a view whose last
    dim is contiguous is read in place): its q heads as ``norm_rope_cpu`` gives them; its k heads the same way
    (``k_weight``) and its v heads as they are written into row ``row_ids[positions[t]]`` of the pools ``keys``
    / ``values`` (contiguous float32 rows ``[..., nkv, D]``, written in place). Needs :func:`cpu_kernels`; a
    position or row outside the tables is a ValueError before anything is written (checked here, as for
    ``qlinear_grouped``), unless ``check_rows`` is False: the caller vouches for them (a KV cache's row ids for
    its session's positions)."""
    if check_rows:
        _check_ids("qkv_rope_cpu", "a position", positions, row_ids.shape[0], "row ids")
        head_rows = qkv.shape[1] // (n_heads + 2 * n_kv_heads) * n_kv_heads  # floats a pool row holds
        _check_ids("qkv_rope_cpu", "a row", row_ids[positions], keys.numel() // max(1, head_rows), "rows of the pools")
    return torch.ops.strata.qkv_rope_cpu(qkv, q_weight, k_weight, eps, positions.to(torch.long), inv_freq, mscale,
                                         n_heads, n_kv_heads, keys, values, row_ids)


def add_rms_norm_cpu(h: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(h + delta, rms_norm_cpu(h + delta, weight, eps))`` of float32 ``[T, H]`` rows in one call: a residual
    add and the norm after it, the bits of the two. Needs :func:`cpu_kernels`."""
    return torch.ops.strata.add_rms_norm_cpu(h, delta, weight, eps)


def route_cpu(logits: Tensor, k: int, norm: bool, scale: float, min_sum: float) -> tuple[Tensor, Tensor]:
    """``(ids int64 [T, k], weights float32 [T, k])`` of float32 router ``logits [T, E]``: the softmax's k
    largest probabilities, largest first (ties: the lower expert), renormalised to sum 1 with ``norm``
    (the sum clamped to ``min_sum``), times ``scale``. Needs :func:`cpu_kernels`."""
    return torch.ops.strata.route_cpu(logits, k, norm, scale, min_sum)


def combine_cpu(rows: Tensor, weights: Tensor, residual: Tensor | None = None) -> Tensor:
    """``[T, H]`` float32: ``residual`` (if given) plus ``sum_j rows[:, j] * weights[:, j, None]`` of ``rows
    [T, k, H]`` and ``weights [T, k]``, j ascending. Needs :func:`cpu_kernels`."""
    return torch.ops.strata.combine_cpu(rows, weights, residual)


def dequantize_blocks(raw: Tensor, qtype: int, dtype: torch.dtype | None = None) -> Tensor | None:
    """The values ``[n_blocks * block values]`` of the whole ``qtype`` blocks in uint8 ``raw`` (the values the
    products decode: bit for bit the torch reference's) in float32, or written straight in ``dtype`` (bfloat16,
    float16: the float32 values' ``.to(dtype)``, without a float32 copy), threaded over the blocks; None
    where the kernels are not loaded or do not cover ``qtype`` or ``dtype``."""
    if (int(qtype) not in CPU_KERNEL_TYPES or raw.numel() % GGML_QUANT_SIZES[T(int(qtype))][1]
            or dtype not in (None, torch.float32, torch.bfloat16, torch.float16) or not cpu_kernels()):
        return None
    return torch.ops.strata.dequantize_blocks(raw.reshape(-1).contiguous(), int(qtype), dtype)


def _check(x: Tensor, weights: list[Tensor], counts: list[int], qtype: int, out: int) -> None:
    """ValueError unless ``qlinear_grouped``'s arguments fit one another (module doc)."""
    if qtype not in CPU_KERNEL_TYPES:
        raise ValueError(f"qlinear_grouped: no CPU kernel for {T(qtype).name}")
    if x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(f"qlinear_grouped: x must be a 2-D CPU tensor, got {tuple(x.shape)} on {x.device}")
    if len(weights) != len(counts) or any(c < 0 for c in counts) or sum(counts) != x.shape[0]:
        raise ValueError(f"qlinear_grouped: {len(weights)} weights for counts {list(counts)} (counts sum to "
                         f"{sum(counts)}, x has {x.shape[0]} rows)")
    values, size = GGML_QUANT_SIZES[T(qtype)]
    if x.shape[1] % values:
        raise ValueError(f"qlinear_grouped: row length {x.shape[1]} is not a multiple of {values}")
    want = out * x.shape[1] // values * size
    for i, w in enumerate(weights):
        if w.dtype != torch.uint8 or w.device.type != "cpu" or w.numel() != want:
            raise ValueError(f"qlinear_grouped: weight {i} is {w.numel()} {w.dtype} on {w.device}, expected "
                             f"{want} uint8 bytes on the CPU")


def _check_ids(op: str, what: str, ids: Tensor, n: int, of: str) -> None:
    """ValueError unless every value of ``ids`` lies in ``[0, n)`` (``what``: the values' name, ``of``: the
    ``n`` things they index)."""
    if ids.numel():
        low, high = (int(v) for v in torch.aminmax(ids))
        if low < 0 or high >= n:
            raise ValueError(f"{op}: {what} outside the {n} {of} (values {low}..{high})")


def _check_slots(x: Tensor, rep: int, buffer: Tensor, slot: Tensor, offsets: Sequence[int], qtype: int,
                 out: int) -> None:
    """ValueError unless ``qlinear_slots``' arguments fit one another."""
    _check_pairs("qlinear_slots", x, rep, buffer, slot)
    _check_matrices("qlinear_slots", x.shape[1], buffer, offsets, qtype, out)


def _check_pairs(op: str, x: Tensor, rep: int, buffer: Tensor, slot: Tensor) -> None:
    """ValueError unless ``x``, ``rep``, ``buffer`` and ``slot`` fit one another (a slot op's pairs)."""
    if x.dim() != 2 or x.device.type != "cpu" or rep < 1 or slot.numel() != x.shape[0] * rep:
        raise ValueError(f"{op}: {slot.numel()} pairs for x {tuple(x.shape)} on {x.device} times {rep}")
    if buffer.dim() != 2 or buffer.dtype != torch.uint8 or buffer.device.type != "cpu" or not buffer.is_contiguous():
        raise ValueError(f"{op}: buffer must be contiguous 2-D uint8 on the CPU, got {tuple(buffer.shape)} "
                         f"{buffer.dtype} on {buffer.device}")
    if slot.dim() != 1 or slot.dtype != torch.long or slot.device.type != "cpu":
        raise ValueError(f"{op}: slot must be 1-D int64 on the CPU, got {tuple(slot.shape)} {slot.dtype}")


def _check_matrices(op: str, K: int, buffer: Tensor, offsets: Sequence[int], qtype: int, out: int) -> None:
    """ValueError unless matrices of ``out`` rows of ``K`` values in ``qtype`` blocks fit rows of ``buffer`` at
    ``offsets``."""
    _matrices_fit(op, K, buffer.shape[1], tuple(offsets), qtype, out)


@functools.lru_cache(maxsize=256)
def _ffn_fits(op: str, H: int, stride: int, offsets: tuple[int, ...], qtypes: tuple[int, ...], ffn_dim: int) -> None:
    """ValueError unless an expert's gate, up and down matrices (``ffn_dim`` x H, ``ffn_dim`` x H, H x ``ffn_dim``
    in ``qtypes``) fit rows of ``stride`` bytes at ``offsets``."""
    for name, off, qtype, K, out in (("gate", offsets[0], qtypes[0], H, ffn_dim),
                                     ("up", offsets[1], qtypes[1], H, ffn_dim),
                                     ("down", offsets[2], qtypes[2], ffn_dim, H)):
        _matrices_fit(f"{op} ({name})", K, stride, (int(off),), int(qtype), out)


@functools.lru_cache(maxsize=1024)  # a decode token asks the same few questions every layer
def _matrices_fit(op: str, K: int, stride: int, offsets: tuple[int, ...], qtype: int, out: int) -> None:
    """``_check_matrices`` of a buffer's row of ``stride`` bytes (an answer that raises is not kept)."""
    if qtype not in CPU_KERNEL_TYPES:
        raise ValueError(f"{op}: no CPU kernel for {T(qtype).name}")
    values, size = GGML_QUANT_SIZES[T(qtype)]
    if K % values:
        raise ValueError(f"{op}: row length {K} is not a multiple of {values}")
    need = out * K // values * size
    if any(off < 0 or off + need > stride for off in offsets):
        raise ValueError(f"{op}: matrices of {need} bytes at {list(offsets)} do not fit rows of {stride} bytes")
