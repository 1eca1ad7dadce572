"""``strata::moe_pair_rows``: every routed (token, j) pair's expert FFN, read from wherever the expert is.

``moe_pair_rows(x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes) -> [P, H]``

- ``x [T, H]``: the MoE input of the window's tokens; pair p computes on token ``p // topk``;
- ``slots [S, >= total]`` uint8: a device's expert cache; ``arena [E, total]`` uint8: the layer's
  packed experts (pinned host memory, or a device tensor);
- ``slot [P]``: pair p's cache slot, -1 = not resident (read ``arena[expert[p]]``); ``expert [P]``;
- ``qtypes`` / ``shapes`` / ``nbytes``: the gate, up and down matrices of one packed expert
  (``shapes`` flat: gate ``[F, H]``, up ``[F, H]``, down ``[H, F]``).

Row p is ``down_e(silu(gate_e x) * up_e x)`` for ``e = expert[p]``, in ``x.dtype``. The optional
trailing arguments (``ffn_args(ExpertFFN)``: ``gate_bias``, ``up_bias``, ``down_bias``, ``act``,
``alpha``, ``limit``) add expert e's biases to its gate/up products and to its row and pick the
activation (gpt-oss: swiglu_oai); the CUDA kernels apply them in registers. The op knows nothing of
topologies or residency tables: a caller finds ``slot`` from its table on the device.

CPU kernel (the oracle): the gather reference of :mod:`strata_core.ops.gather`, then
:func:`pair_ffn_reference`: the CPU block kernels (:mod:`strata_core.ops.cpu_kernels`, one weight a
pair) where they cover the formats, else dequantize every pair's blocks and per-pair batched products
in float32; cast step by step like ``expert_ffn`` either way.

CUDA kernel (:mod:`strata_core.ops.moe_kernels`, launched by :mod:`strata_core.ops.moe_triton`, which
registers them for the ops here where Triton is installed): two
Triton launches that read the quantized blocks once and never write a weight: ``gate_up`` (grid pairs x F/BN: each program decodes BN rows of gate
and of up with the shared :func:`strata_core.ops.qdecode.decode`, dots them with the token's activations in float32 and
stores ``silu(g) * u``) and ``down`` (grid pairs x H/BN, the same over the float32 ``h``). A pair's
weights are found on the device: ``slots + slot * stride`` when resident; a miss in a pinned host
arena is first copied over the link into a device staging row by the gather kernel, which skips
resident pairs (the default: the copy moves 8-byte words at nearly the link's bandwidth, where
byte-wise decoding loads straight from host memory would not), or read zero-copy by the decode
kernels (the ops' keyword ``direct_misses=True``; the setting ``miss_read = "direct"``). No host read
of the routing either way: one fixed launch sequence a layer, capturable in a CUDA graph. Formats outside ``KERNEL_TYPES`` run the reference on the
device (logged once).

``moe_decode(x, slots, arena, slot, expert, weights, topk, qtypes, shapes, nbytes) -> [T, H]`` is the
same with the rows combined: ``sum_j weights[t, j] * row(t * topk + j)`` (``combine_rows``); on CUDA
its down launch sums a token's pairs in registers in that fixed order (grid tokens x H/BN), so a
decode layer's routed output takes two launches and no ``[P, H]`` rows.

Rows computed on another device (a peer tier, experts/device_rows.py) join that combination exactly:
``moe_decode_rows(x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes) -> [P, H]`` float32 is
the combining launch storing each pair's row instead of summing it (the same tiles, the same
arithmetic), and ``moe_decode(..., served=[P] bool, served_rows=[P, H] float32)`` takes those rows in
place of its own for the flagged pairs, so the output is bit for bit that of one device holding every
expert, whichever device computed which row (tests/test_moe_served.py). With ``staged=True`` the
``arena`` argument is ``[P, total]``: each missed pair's expert staged in its own row already
(``gather_experts(..., skip_hits=True)``), so a home can stage its misses over its link while a peer
computes, before it waits for the peer's rows (experts/device_rows.py).

How the launches split the work (rows per program, K splits, warps; the "loop" design described
above, the "split" design, or for batches the "q8" design: Q4_K against int8 activations by dp4a) is
a :class:`LaunchConfig`: :data:`DEFAULT_LAUNCH` unless a caller runs
the ops inside ``with launched_with(config):`` (tools/moe_sweep.py and tools/profile_decode.py time
alternatives that way). A window of ``LaunchConfig.grouped_pairs`` pairs or more (a batch of
sessions) takes the grouped design instead (:mod:`strata_core.ops.moe_grouped`): the pairs sorted by
expert on the device, each routed expert's weights decoded once for all its pairs, so the work grows
with the distinct experts rather than with the pairs; its rows are combined in pair order too.

Tolerance against the reference: float32 within a relative 1e-5 (summation order), bf16 within
2e-2 (tests/test_kernels_cuda.py, tests/test_moe_grouped.py, tests/test_moe_q8.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from strata_core.experts.cpu_ffn import cpu_experts_ffn, takes_cpu_kernels
from strata_core.experts.ffn import ACTIVATIONS, SILU, ExpertFFN
from strata_core.ops.combine import combine_rows
from strata_core.ops.gather import _reference as _gather_reference
from strata_core.ops.matmul import matmul
from strata_core.quant.registry import dequantize_reference

__all__ = ["DEFAULT_LAUNCH", "LaunchConfig", "ffn_args", "launch_config", "launched_with", "moe_decode",
           "moe_decode_rows", "moe_pair_rows", "pair_ffn_reference", "parse_launch", "set_default_launch",
           "stages_misses"]


@dataclass(frozen=True)
class LaunchConfig:
    """How the CUDA kernels are launched (read on the host at each launch: :func:`launch_config`).

    ``design``: ``"loop"`` — gate_up programs (pair, BN rows) loop over K; the combining down's programs
    (token, BN rows) loop over the token's pairs; ``"split"`` — gate_up programs (pair, BN rows, K split)
    store float32 partial gate / up products (``split_k`` of them, summed and activated in a fixed order
    where the down launch loads ``h``; ``split_k == 1``: activated in place), and the down programs
    (token, BN rows) decode every pair of the token at once (``[pairs, BN, sub-blocks, SUB]`` tiles),
    combined over the pairs in a fixed order; Q4_K matrices whose bytes are 16-byte aligned are read
    as 16-byte loads of their nibbles (``fast_q4k``); ``"split-loop"`` — the split design's gate_up
    (``split_k`` 1) with the loop design's down launches (the sweep showed the split gate_up and the
    loop's combining down the faster ones for one token). All are deterministic (no atomics).
    ``tile``: values a program decodes per step; ``bn_*``: rows per program of the gate_up, down
    (``moe_pair_rows``) and combining down (``moe_decode``) launches; ``warps_*``: their num_warps.
    Defaults: the fastest in the engine on the H200 (``tools/profile_decode.py --moe-config``, one decode
    token of the 30B shapes, every expert resident; see BENCHMARKS.md): ``split`` with 4 rows a gate_up
    program and 16 a combining program, each faster than 8; in the engine the loop design's combining
    down was well behind. tools/moe_sweep.py times one layer alone.

    ``"q8"`` — for a window of ``q8_pairs`` pairs or more with bf16 / fp16 activations, Q4_K matrices
    are dotted with the activations quantized to int8 by ``dp4a`` (:mod:`strata_core.ops.moe_q8`;
    ``warps_q8`` warps, ``bn_gate_up`` / ``bn_combine`` / ``bn_down`` rows a program); everything else
    as "split" (a single token's 8 pairs are faster there: 27 against 44 µs a layer of the 30B; at 8
    tokens q8 takes 92 µs to split's 155, at 32 267 to 565; tools/moe_sweep.py, BENCHMARKS.md).

    ``grouped``: a window of ``grouped_pairs`` pairs or more takes the grouped design instead
    (:mod:`strata_core.ops.moe_grouped`: each routed expert decoded once per window, its pairs as the
    ``bm`` rows of a ``tl.dot``; ``bn_grouped`` output rows and ``kt`` values of K a program step,
    ``warps_grouped`` warps); below it nearly every pair has an expert of its own (8 of 128 experts a
    token: 16 pairs share ~1 expert, 32 pairs ~4), so the per-pair kernels' fewer launches win.
    ``dot_precision``: ``tl.dot``'s input precision for the float32 operands (``"ieee"``: FMAs,
    ``bm`` of them per decoded weight; ``"tf32x3"``: three tensor-core products, within ~1e-6 of
    float32; ``"tf32"``: one, ~1e-3) or ``"bf16"`` (both operands rounded to bf16); accumulation is float32 in
    every case.
    """

    design: str = "q8"
    tile: int = 4096
    bn_gate_up: int = 4
    bn_down: int = 16
    bn_combine: int = 16
    warps_gate_up: int = 4
    warps_down: int = 4
    warps_combine: int = 4
    split_k: int = 1
    fast_q4k: bool = True
    q8_pairs: int = 16
    warps_q8: int = 2
    grouped: bool = False  # measured slower than the split design at 1, 8 and 32 sessions (BENCHMARKS.md)
    grouped_pairs: int = 32
    bm: int = 16
    bn_grouped: int = 32
    kt: int = 64
    warps_grouped: int = 4
    dot_precision: str = "tf32x3"

    def __post_init__(self) -> None:
        if self.design not in ("loop", "split", "split-loop", "q8"):
            raise ValueError(f"LaunchConfig.design: {self.design!r} is not 'loop', 'split', 'split-loop' or 'q8'")
        if self.design == "split-loop" and self.split_k != 1:
            raise ValueError("LaunchConfig: the loop design's down launch takes activated h (split_k 1)")
        if self.dot_precision not in DOT_PRECISIONS:
            raise ValueError(f"LaunchConfig.dot_precision: {self.dot_precision!r} is not one of {DOT_PRECISIONS}")
        for name in ("grouped_pairs", "q8_pairs"):
            if getattr(self, name) < 1:
                raise ValueError(f"LaunchConfig.{name}: {getattr(self, name)} is not positive")
        for name in ("tile", "bn_gate_up", "bn_down", "bn_combine", "warps_gate_up", "warps_down",
                     "warps_combine", "split_k", "bm", "bn_grouped", "kt", "warps_grouped", "warps_q8"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"LaunchConfig.{name}: {v} is not a power of two")
        # tl.dot's smallest tile is 16 a side; a K step holds whole sub-blocks (16 or 32 values)
        for name, least in (("bm", 16), ("bn_grouped", 16), ("kt", 32)):
            if getattr(self, name) < least:
                raise ValueError(f"LaunchConfig.{name}: {getattr(self, name)} is below {least}")

    def groups(self, pairs: int) -> bool:
        """Whether a window of ``pairs`` (token, expert) pairs takes the grouped design."""
        return self.grouped and pairs >= self.grouped_pairs


#: The values of ``LaunchConfig.dot_precision``.
DOT_PRECISIONS = ("ieee", "tf32x3", "tf32", "bf16")


#: The launch configuration of the CUDA kernels outside any ``launched_with``.
DEFAULT_LAUNCH = LaunchConfig()

_launch = [DEFAULT_LAUNCH]  # the innermost ``launched_with``'s config last


def parse_launch(spec: str, base: LaunchConfig = DEFAULT_LAUNCH) -> LaunchConfig:
    """``base`` with the fields ``spec`` names replaced (``name=value,...``, e.g. ``grouped=True,dot_precision=bf16``);
    a ValueError names an unknown field or a value the field cannot take."""
    kinds = {f.name: f.type for f in dataclasses.fields(LaunchConfig)}
    changes: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, value = item.partition("=")
        if name not in kinds:
            raise ValueError(f"{name!r} is not a field of the MoE launch configuration ({', '.join(kinds)})")
        kind = kinds[name]
        if kind == "bool" and value not in ("True", "False", "true", "false"):
            raise ValueError(f"{name}={value!r}: not true or false")
        try:
            changes[name] = value in ("True", "true") if kind == "bool" else int(value) if kind == "int" else value
        except ValueError:
            raise ValueError(f"{name}={value!r}: not an integer") from None
    return dataclasses.replace(base, **changes)


def set_default_launch(config: LaunchConfig) -> None:
    """Make ``config`` what the kernels use outside any ``launched_with`` in this process (``--moe-config``)."""
    _launch[0] = config


def launch_config() -> LaunchConfig:
    """The launch configuration the CUDA kernels use now: the innermost :func:`launched_with`'s, else
    :data:`DEFAULT_LAUNCH`."""
    return _launch[-1]


@contextmanager
def launched_with(config: LaunchConfig) -> Iterator[LaunchConfig]:
    """Launch the CUDA kernels as ``config`` says inside the block (a tuning sweep or a test of another
    design; a CUDA graph captured inside replays those launches)."""
    _launch.append(config)
    try:
        yield config
    finally:
        _launch.pop()

#: the optional arguments of both ops: the experts' biases (``[E, F]``, ``[E, F]``, ``[E, H]``, indexed
#: by ``expert[p]``) and the activation (``ACTIVATIONS`` index: 0 silu, 1 swiglu_oai with alpha, limit)
_FFN_ARGS = "Tensor? gate_bias=None, Tensor? up_bias=None, Tensor? down_bias=None, int act=0, " \
            "float alpha=1.702, float limit=7.0"
#: the keyword of all three ops: the CUDA kernels read a miss in a host arena zero-copy (True) rather than
#: stage it in a device row first (module doc); the CPU reference computes the same rows either way
_MISS_ARG = "bool direct_misses=False"
_SCHEMA = ("(Tensor x, Tensor slots, Tensor arena, Tensor slot, Tensor expert, int topk, int[] qtypes, "
           f"int[] shapes, int[] nbytes, {_FFN_ARGS}, *, {_MISS_ARG}) -> Tensor")


def ffn_args(ffn: ExpertFFN) -> dict:
    """The keyword arguments of ``moe_pair_rows`` / ``moe_decode`` that carry ``ffn``."""
    return dict(gate_bias=ffn.gate_bias, up_bias=ffn.up_bias, down_bias=ffn.down_bias,
                act=ACTIVATIONS.index(ffn.activation), alpha=ffn.alpha, limit=ffn.limit)


def _ffn(gate_bias: Tensor | None = None, up_bias: Tensor | None = None, down_bias: Tensor | None = None,
         act: int = 0, alpha: float = 1.702, limit: float = 7.0) -> ExpertFFN:
    """The ``ExpertFFN`` of the ops' trailing arguments (``_FFN_ARGS``)."""
    return ExpertFFN(ACTIVATIONS[act], gate_bias, up_bias, down_bias, alpha=alpha, limit=limit)


def _pair_linear(x: Tensor, raw: Tensor, qtype: int, shape: Sequence[int]) -> Tensor:
    """``x [P, in]`` times pair p's own ``W_p`` (``raw [P, bytes]``, ``shape == (out, in)``) transposed
    -> ``[P, out]``, computed in float32 and returned in ``x.dtype`` like ``quant_matmul``."""
    weight = dequantize_reference(raw, qtype, (raw.shape[0], *shape))  # [P, out, in] float32
    return matmul(x.float()[:, None, :], weight.transpose(1, 2))[:, 0].to(x.dtype)  # [P, out]


def pair_ffn_reference(x: Tensor, gate: Tensor, up: Tensor, down: Tensor, qtypes: Sequence[int],
                       shapes: Sequence[Sequence[int]], ffn: ExpertFFN = SILU, expert: Tensor | None = None) -> Tensor:
    """Rows ``[P, H]``: pair p's expert (blocks ``gate[p]``, ``up[p]``, ``down[p]``) on ``x[p]`` (``[P, H]``);
    ``ffn`` other than plain SiLU: its activation and the biases of ``expert [P]`` (as ``expert_ffn``).
    On the CPU the block kernels compute it where they cover the formats, one weight each pair, so a
    pair's row has the bits ``expert_ffn`` gives it."""
    if takes_cpu_kernels(x, qtypes, shapes):
        experts = () if expert is None else expert
        return cpu_experts_ffn(x, list(zip(gate, up, down)), [1] * x.shape[0], qtypes, shapes, ffn, experts)
    g = _pair_linear(x, gate, qtypes[0], shapes[0])  # [P, F]
    u = _pair_linear(x, up, qtypes[1], shapes[1])  # [P, F]
    return ffn.post(_pair_linear(ffn.hidden(g, u, expert), down, qtypes[2], shapes[2]), expert)  # [P, H]


def _split(packed: Tensor, nbytes: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
    g, u, d = nbytes
    return packed[:, :g], packed[:, g:g + u], packed[:, g + u:g + u + d]


def _shapes(shapes: Sequence[int]) -> tuple[tuple[int, int], ...]:
    return tuple((shapes[i], shapes[i + 1]) for i in range(0, 6, 2))


def _reference(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, topk: int,
               qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int], *ffn,
               by_pair: bool = False, gather=None, direct_misses: bool = False) -> Tensor:
    """The oracle: gather every pair's packed bytes (``by_pair``: a miss from ``arena``'s row of its
    pair, ``moe_decode``'s ``staged``), then :func:`pair_ffn_reference` (``ffn``: the trailing
    ``_FFN_ARGS``). ``gather``: a ``gather_experts`` reading ``arena`` where it is (the CUDA kernels'
    fallback); by default the CPU gather of a copy of ``arena`` on ``slots``' device."""
    pair = torch.arange(slot.shape[0], device=slot.device)  # [P]
    source = pair if by_pair else expert  # each pair's row of ``arena`` where it misses
    if gather is None:
        packed = _gather_reference(slots, arena.to(slots.device), slot, source, sum(nbytes))  # [P, total]
    else:
        packed = gather(slots, arena, slot, source, sum(nbytes))
    xp = x[pair.to(x.device) // topk]  # [P, H]
    return pair_ffn_reference(xp, *_split(packed, nbytes), qtypes, _shapes(shapes), _ffn(*ffn), expert).contiguous()


def stages_misses(slots: Tensor, arena: Tensor, direct_misses: bool = False) -> bool:
    """Whether the CUDA kernels copy a layer's misses into device rows first (a host ``arena``, not
    ``direct_misses``) rather than read ``arena`` in place."""
    return not (arena.device == slots.device or direct_misses)


def _combined(rows: Tensor, weights: Tensor, served: Tensor | None, served_rows: Tensor | None) -> Tensor:
    """``combine_rows`` of ``rows [P, H]`` (a pair flagged in ``served [P]``: its row of ``served_rows``)."""
    if served is not None:
        rows = torch.where(served[:, None], served_rows.to(rows.dtype), rows)
    return combine_rows(rows.view(weights.shape[0], weights.shape[1], -1), weights).contiguous()


def _decode_reference(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, weights: Tensor,
                      topk: int, qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int],
                      gate_bias: Tensor | None = None, up_bias: Tensor | None = None, down_bias: Tensor | None = None,
                      act: int = 0, alpha: float = 1.702, limit: float = 7.0, served: Tensor | None = None,
                      served_rows: Tensor | None = None, staged: bool = False, direct_misses: bool = False) -> Tensor:
    """The oracle of ``moe_decode``: the rows of :func:`_reference` (the ``served`` pairs' taken from
    ``served_rows``; ``staged``: ``arena`` holds a row per pair, the misses staged), combined by
    ``combine_rows``."""
    rows = _reference(x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes, gate_bias, up_bias, down_bias,
                      act, alpha, limit, by_pair=staged)  # [P, H]
    return _combined(rows, weights, served, served_rows)


def _decode_fake(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, weights: Tensor,
                 topk: int, qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int], *args,
                 direct_misses: bool = False) -> Tensor:
    return x.new_empty((x.shape[0], shapes[4]))


def _rows_reference(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, topk: int,
                    qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int], *ffn,
                    direct_misses: bool = False) -> Tensor:
    """The oracle of ``moe_decode_rows``: the rows of :func:`_reference` in float32."""
    return _reference(x, slots, arena, slot, expert, topk, qtypes, shapes, nbytes, *ffn).float()


def _rows_fake(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, topk: int,
               qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int], *ffn,
               direct_misses: bool = False) -> Tensor:
    return x.new_empty((slot.shape[0], shapes[4]), dtype=torch.float32)


def _fake(x: Tensor, slots: Tensor, arena: Tensor, slot: Tensor, expert: Tensor, topk: int,
          qtypes: Sequence[int], shapes: Sequence[int], nbytes: Sequence[int], *ffn,
          direct_misses: bool = False) -> Tensor:
    return x.new_empty((slot.shape[0], shapes[4]))

moe_pair_rows = torch.library.custom_op("strata::moe_pair_rows", _reference, mutates_args=(), schema=_SCHEMA)
moe_pair_rows.register_fake(_fake)

moe_decode = torch.library.custom_op(
    "strata::moe_decode", _decode_reference, mutates_args=(),
    schema=("(Tensor x, Tensor slots, Tensor arena, Tensor slot, Tensor expert, Tensor weights, int topk, "
            f"int[] qtypes, int[] shapes, int[] nbytes, {_FFN_ARGS}, Tensor? served=None, "
            f"Tensor? served_rows=None, bool staged=False, *, {_MISS_ARG}) -> Tensor"))
moe_decode.register_fake(_decode_fake)

moe_decode_rows = torch.library.custom_op("strata::moe_decode_rows", _rows_reference, mutates_args=(), schema=_SCHEMA)
moe_decode_rows.register_fake(_rows_fake)
