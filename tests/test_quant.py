"""Block formats against gguf-py's numpy dequantizers: bit-exact, for every supported type."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_core.errors import ModelFileError, UnsupportedError
from strata_core.quant import (
    QUANTIZABLE_TYPES,
    SUPPORTED_TYPES,
    bytes_for,
    check_shape,
    dequantize,
    quantize,
    random_blocks,
)
from strata_core.quant.registry import CPU_CHUNK_VALUES

TYPES = sorted(SUPPORTED_TYPES)
EXAMPLES = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reference(blocks: np.ndarray, qtype: T, rows: int) -> np.ndarray:
    """gguf-py's dequantization of ``rows`` rows of ``blocks`` (float32, ``[rows, row_len]``)."""
    with np.errstate(all="ignore"):  # arbitrary bytes give NaN / inf scales
        return gguf_quants.dequantize(blocks.reshape(rows, -1), qtype)


def assert_bit_exact(got: torch.Tensor, want: np.ndarray) -> None:
    """Same shape, NaN at the same places, identical float32 bits everywhere else."""
    assert got.dtype == torch.float32
    got_np = got.numpy()
    assert got_np.shape == want.shape
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got_np), nan)
    np.testing.assert_array_equal(got_np[~nan].view(np.int32), want[~nan].view(np.int32))


def layout(qtype: T, rows: int, blocks_per_row: int) -> tuple[int, tuple[int, int]]:
    """(number of blocks, logical shape) of a ``rows`` x ``blocks_per_row`` tensor."""
    block_size, _ = GGML_QUANT_SIZES[qtype]
    return rows * blocks_per_row, (rows, blocks_per_row * block_size)


def test_supported_types_are_the_documented_set() -> None:
    names = {
        "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
        "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S",
        "IQ1_S", "IQ1_M", "MXFP4",
    }  # fmt: skip
    assert {t.name for t in SUPPORTED_TYPES} == names


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@EXAMPLES
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 3), blocks_per_row=st.integers(1, 4))
def test_random_blocks_match_gguf_bit_exact(qtype: T, seed: int, rows: int, blocks_per_row: int) -> None:
    n_blocks, shape = layout(qtype, rows, blocks_per_row)
    blocks = random_blocks(qtype, n_blocks, np.random.default_rng(seed), scale=0.05)
    got = dequantize(torch.from_numpy(blocks), qtype, shape)
    want = reference(blocks, qtype, rows)
    assert_bit_exact(got, want)
    assert np.isfinite(want).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@EXAMPLES
@given(data=st.data(), rows=st.integers(1, 2), blocks_per_row=st.integers(1, 3))
def test_arbitrary_bytes_match_gguf_bit_exact(qtype: T, data: st.DataObject, rows: int, blocks_per_row: int) -> None:
    n_blocks, shape = layout(qtype, rows, blocks_per_row)
    size = n_blocks * GGML_QUANT_SIZES[qtype][1]
    raw = np.frombuffer(data.draw(st.binary(min_size=size, max_size=size)), dtype=np.uint8)
    got = dequantize(torch.from_numpy(raw.copy()), qtype, shape)
    assert_bit_exact(got, reference(raw, qtype, rows))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.IQ2_XXS, T.F16], ids=lambda t: t.name)
def test_large_tensor_dequantized_in_chunks_matches_gguf(qtype: T) -> None:
    block_size, _ = GGML_QUANT_SIZES[qtype]
    rows = 3 * CPU_CHUNK_VALUES // (4 * block_size) + 1  # several chunks and a partial one
    n_blocks, shape = layout(qtype, rows, 4)
    blocks = random_blocks(qtype, n_blocks, np.random.default_rng(7))
    got = dequantize(torch.from_numpy(blocks).reshape(rows, -1), qtype, shape)
    assert_bit_exact(got, reference(blocks, qtype, rows))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_empty_tensor_dequantizes_to_empty(qtype: T) -> None:
    blocks = random_blocks(qtype, 0, np.random.default_rng(0))
    got = dequantize(torch.from_numpy(blocks), qtype, (0, GGML_QUANT_SIZES[qtype][0]))
    assert got.shape == (0, GGML_QUANT_SIZES[qtype][0]) and got.dtype == torch.float32


@pytest.mark.parametrize("qtype", [T.F32, T.BF16, T.Q2_K, T.Q5_0, T.IQ3_XXS, T.IQ1_M], ids=lambda t: t.name)
@pytest.mark.parametrize("n_blocks", [1, 3])
def test_unaligned_raw_bytes_match_gguf(qtype: T, n_blocks: int) -> None:
    blocks = random_blocks(qtype, n_blocks, np.random.default_rng(3))
    buffer = torch.zeros(1 + blocks.size, dtype=torch.uint8)
    raw = buffer[1:]  # storage offset 1, as a tensor sliced out of a file mapping can be
    raw.copy_(torch.from_numpy(blocks.reshape(-1)))
    got = dequantize(raw, qtype, layout(qtype, 1, n_blocks)[1])
    assert_bit_exact(got, reference(blocks, qtype, 1))


def test_dequantize_keeps_a_3d_shape() -> None:
    blocks = random_blocks(T.Q8_0, 2 * 3 * 2, np.random.default_rng(0))
    got = dequantize(torch.from_numpy(blocks), T.Q8_0, (2, 3, 64))
    assert got.shape == (2, 3, 64)
    assert_bit_exact(got.reshape(6, 64), reference(blocks, T.Q8_0, 6))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0])
def test_random_blocks_are_finite_and_of_the_requested_magnitude(qtype: T, scale: float) -> None:
    n_blocks = 64
    blocks = random_blocks(qtype, n_blocks, np.random.default_rng(1), scale=scale)
    assert blocks.dtype == np.uint8 and blocks.shape == (n_blocks, GGML_QUANT_SIZES[qtype][1])
    values = dequantize(torch.from_numpy(blocks), qtype, layout(qtype, 1, n_blocks)[1])
    assert torch.isfinite(values).all()
    peak = values.abs().max().item()
    assert scale / 8 <= peak <= 4 * scale


def test_random_blocks_depend_on_the_generator_state() -> None:
    a = random_blocks(T.Q4_K, 4, np.random.default_rng(0))
    b = random_blocks(T.Q4_K, 4, np.random.default_rng(0))
    c = random_blocks(T.Q4_K, 4, np.random.default_rng(1))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize("qtype", sorted(QUANTIZABLE_TYPES), ids=lambda t: t.name)
def test_quantize_round_trips_through_dequantize(qtype: T) -> None:
    values = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
    raw = quantize(values, qtype)
    assert raw.dtype == np.uint8 and raw.shape == (3, bytes_for(qtype, (3, 64)) // 3)
    got = dequantize(torch.from_numpy(raw), qtype, values.shape)
    assert_bit_exact(got, reference(raw, qtype, 3))
    assert np.abs(got.numpy() - values).max() <= 0.3 * np.abs(values).max()


def test_quantize_rejects_a_type_gguf_cannot_write() -> None:
    with pytest.raises(UnsupportedError, match=r"Q4_K.*quantizable: F32, F16, Q4_0"):
        quantize(np.zeros((1, 256), np.float32), T.Q4_K)


@pytest.mark.parametrize("qtype", [T.Q8_1, T.TQ1_0, 99])
def test_unsupported_type_is_named_with_the_supported_list(qtype: int) -> None:
    expected = T(qtype).name if qtype in T._value2member_map_ else f"type {qtype}"
    with pytest.raises(UnsupportedError, match=rf"{expected} is not supported; supported: F32, F16, Q4_0"):
        check_shape(qtype, (1, 256))
    with pytest.raises(UnsupportedError):
        dequantize(torch.zeros(300, dtype=torch.uint8), qtype, (1, 256))


def test_wrong_byte_count_states_expected_and_got() -> None:
    with pytest.raises(ModelFileError, match=r"blk\.0: Q4_K shape \(2, 512\) needs 576 bytes, got 575"):
        check_shape(T.Q4_K, (2, 512), 575, name="blk.0")
    with pytest.raises(ModelFileError, match="needs 576 bytes, got 580"):
        dequantize(torch.zeros(580, dtype=torch.uint8), T.Q4_K, (2, 512))


def test_row_length_must_be_a_multiple_of_the_block_size() -> None:
    with pytest.raises(ModelFileError, match="row length 100 .* not a multiple of the Q4_0 block size 32"):
        bytes_for(T.Q4_0, (4, 100))


def test_bytes_for_counts_whole_blocks() -> None:
    assert bytes_for(T.Q4_K, (128, 4096)) == 128 * 16 * 144
    assert bytes_for(T.MXFP4, (3, 2, 64)) == 6 * 2 * 17
    assert bytes_for(T.F32, (5,)) == 20
