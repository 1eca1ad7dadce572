"""The strata:: custom ops: opcheck, fake kernels, and quant_matmul against gguf-py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import strata_core.ops  # noqa: F401  (registers the ops)
from strata_core.quant import SUPPORTED_TYPES, quant_matmul, random_blocks

OPCHECK_TYPES = [T.F32, T.BF16, T.Q4_1, T.Q5_0, T.Q3_K, T.Q5_K, T.IQ4_XS, T.IQ2_S, T.IQ1_M, T.MXFP4]


def weight(qtype: T, out: int, blocks_per_row: int, seed: int = 0) -> tuple[torch.Tensor, tuple[int, int]]:
    """Random ``[out, in]`` weight blocks of ``qtype`` as a uint8 ``[out, row_bytes]`` tensor."""
    block_size, _ = GGML_QUANT_SIZES[qtype]
    blocks = random_blocks(qtype, out * blocks_per_row, np.random.default_rng(seed), scale=0.1)
    return torch.from_numpy(blocks).reshape(out, -1), (out, blocks_per_row * block_size)


@pytest.mark.parametrize("qtype", OPCHECK_TYPES, ids=lambda t: t.name)
def test_opcheck_dequantize(qtype: T) -> None:
    raw, shape = weight(qtype, 3, 2)
    torch.library.opcheck(torch.ops.strata.dequantize.default, (raw, int(qtype), list(shape)))


@pytest.mark.parametrize("qtype", OPCHECK_TYPES, ids=lambda t: t.name)
def test_opcheck_quant_matmul(qtype: T) -> None:
    raw, shape = weight(qtype, 5, 1)
    x = torch.randn(2, 3, shape[1])
    torch.library.opcheck(torch.ops.strata.quant_matmul.default, (x, raw, int(qtype), list(shape)))


def test_fake_kernels_give_shapes_without_reading_data() -> None:
    raw, shape = weight(T.Q4_K, 4, 2)
    with FakeTensorMode() as mode:
        fake_raw = mode.from_tensor(raw)
        fake_x = torch.empty(7, shape[1], dtype=torch.bfloat16)
        w = torch.ops.strata.dequantize(fake_raw, int(T.Q4_K), list(shape))
        y = torch.ops.strata.quant_matmul(fake_x, fake_raw, int(T.Q4_K), list(shape))
    assert (w.shape, w.dtype) == (torch.Size(shape), torch.float32)
    assert (y.shape, y.dtype) == (torch.Size([7, 4]), torch.bfloat16)


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES), ids=lambda t: t.name)
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), tokens=st.integers(1, 5), out=st.integers(1, 6))
def test_quant_matmul_equals_x_times_reference_transposed(qtype: T, seed: int, tokens: int, out: int) -> None:
    raw, shape = weight(qtype, out, 2, seed)
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((tokens, shape[1]), dtype=np.float32))
    want = x @ torch.from_numpy(gguf_quants.dequantize(raw.numpy(), qtype)).T
    torch.testing.assert_close(quant_matmul(x, raw, qtype, shape), want, rtol=1e-5, atol=1e-5)


def test_quant_matmul_keeps_batch_dims_and_dtype() -> None:
    raw, shape = weight(T.Q6_K, 3, 1)
    x = torch.randn(2, 4, shape[1], dtype=torch.bfloat16)
    y = quant_matmul(x, raw, T.Q6_K, shape)
    assert y.shape == (2, 4, 3) and y.dtype == torch.bfloat16


def test_quant_matmul_rejects_mismatched_input_width() -> None:
    raw, shape = weight(T.Q8_0, 2, 1)
    with pytest.raises(ValueError, match="does not match weight shape"):
        quant_matmul(torch.randn(1, 64), raw, T.Q8_0, shape)
