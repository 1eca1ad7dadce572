"""Strata's torch custom ops, all in the ``strata`` namespace, registered at import.

- ``strata::dequantize(Tensor raw, int qtype, SymInt[] shape, ScalarType? dtype=None) -> Tensor``
  (:mod:`strata_core.ops.quant`; on CUDA the Triton dequantizer of :mod:`strata_core.ops.dequant`)
- ``strata::quant_matmul(Tensor x, Tensor raw, int qtype, SymInt[] shape) -> Tensor``
- ``strata::gather_experts(...)``: routed experts' packed bytes from device slots or, zero-copy,
  from the pinned arena (a Triton kernel on CUDA; see :mod:`strata_core.ops.gather`)
- ``strata::moe_pair_rows(...)``: every routed pair's expert FFN straight from the quantized blocks
  in a slot or the arena, and ``moe_decode`` / ``moe_decode_rows`` (fused Triton decode kernels on CUDA:
  :mod:`strata_core.ops.moe_kernels`, launched by :mod:`strata_core.ops.moe_triton`; see :mod:`strata_core.ops.moe`)
- ``strata::q8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor``: ``x @ W.T`` read straight from a
  repacked Q8_0 matrix (decode's dense products on CUDA; see :mod:`strata_core.ops.dense_q8`)
- ``strata::qlinear_grouped(Tensor x, Tensor[] weights, int[] counts, int qtype, int out_features) -> Tensor``:
  quantized products on the CPU read from the blocks in place, one weight per segment of ``x`` (every CPU
  expert path; a C++ extension compiled on first use, see :mod:`strata_core.ops.cpu_kernels`; its oracle is
  ``x @ dequantize(W).T``, within the CUDA q8 kernels' tolerance where its int8 body runs); ``strata::qlinear_slots(Tensor x, int rep, Tensor buffer, Tensor slot, int[] offsets,
  int qtype, int out_features) -> Tensor``: the same products per (token, k) pair, each pair's weights a row
  of one buffer (a CPU device's cache slots: a layer's routed experts in one call)
- ``strata::attention_cpu(Tensor q, Tensor keys, Tensor values, Tensor positions, int window, Tensor? sinks, Tensor? rows)
  -> Tensor``: the CPU's causal GQA attention, each row's arithmetic fixed by its own query and visible keys
  (batch-invariant by construction; same extension, see :mod:`strata_core.ops.cpu_kernels`)
- ``strata::linear_cpu(Tensor x, Tensor weight) -> Tensor``: the CPU's float32 ``x @ weight.T``, each output one
  fixed-order dot product (rows batch-invariant without padding; :mod:`strata_core.ops.matmul` ``linear``)
- ``strata::mla_attention(...)``: deepseek2's multi-head latent attention over the latent cache
  (Triton flash decoding on CUDA; see :mod:`strata_core.ops.mla`, imported by the deepseek2 model)

:mod:`strata_core.ops.qdecode` holds the per-format block decoding every Triton kernel shares;
:mod:`strata_core.ops.matmul` the batch-invariant CPU products the model uses.

Each op has one contract, a CPU reference kernel (the oracle: ``torch.library.opcheck`` and the
CUDA tests compare against it) and a fake (meta) kernel; device kernels register for the same op.
Triton is optional: without it every op is a plain custom op with its reference. Import this
package before any graph capture.
"""

from strata_core.ops import dense_q8, gather, moe, quant
from strata_core.ops.qdecode import HAS_TRITON

if HAS_TRITON:  # the CUDA kernels of the moe ops (they register themselves for the ops of moe.py)
    from strata_core.ops import moe_triton  # noqa: F401

__all__ = ["dense_q8", "gather", "moe", "quant"]
