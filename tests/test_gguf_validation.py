"""Crafted broken GGUFs: each is a ModelFileError naming the file and the problem, raised at load."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf_corrupt import array_length_slot, layout, set_int, set_metadata, tensor_slot

from strata_core.errors import ModelFileError
from strata_core.gguf.reader import GGUFFile
from strata_core.model.registry import load_model_spec


@pytest.fixture(scope="module")
def model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(expert_type="Q8_0")


def _load(data: bytes, tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(data)
    load_model_spec(GGUFFile.open(path))


def _tensor_offset(model: Path, index: int) -> int:
    return int(GGUFReader(model).tensors[index].field.parts[5][0])


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda m, d: set_int(d, tensor_slot(m, 1, "offset"), 2**64 - 64), "expected"),  # wraps around
        (lambda m, d: set_int(d, tensor_slot(m, 1, "offset"), _tensor_offset(m, 0)), "expected"),  # overlaps
        (lambda m, d: set_int(d, tensor_slot(m, 1, "offset"), _tensor_offset(m, 1) + 1), "expected"),  # misaligned
        (lambda m, d: set_int(d, tensor_slot(m, 3, "offset"), _tensor_offset(m, 4)), "expected"),  # swapped
        (lambda m, d: set_int(d, tensor_slot(m, 1, "type"), GGMLQuantizationType.Q4_0), "tensor")],  # another type
    ids=["wrapping-offset", "overlap", "misaligned", "swapped-offsets", "swapped-type"],
)
def test_tensor_layout_is_checked(model: Path, tmp_path: Path, change, words: str) -> None:
    with pytest.raises(ModelFileError, match=words) as error:
        _load(change(model, model.read_bytes()), tmp_path)
    assert str(tmp_path) in str(error.value) and "tensor" in str(error.value)


def test_huge_counts_fail_fast_without_memory(model: Path, tmp_path: Path) -> None:
    data = model.read_bytes()
    with pytest.raises(ModelFileError, match="more than the file could hold"):
        _load(set_int(data, array_length_slot(model, "tokenizer.ggml.tokens"), 2**60), tmp_path)
    with pytest.raises(ModelFileError, match="block_count is 1099511627776 but the file has tensors of 2 layers"):
        _load(set_metadata(data, layout(model), "qwen3moe.block_count", 2**40), tmp_path)


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("qwen3moe.attention.head_count", 0, "integer >= 1"),
        ("qwen3moe.attention.head_count", "4", "integer >= 1"),
        ("qwen3moe.attention.head_count_kv", 3, "not a multiple"),
        ("qwen3moe.context_length", -5, "integer >= 1"),
        ("qwen3moe.context_length", None, "missing"),
        ("qwen3moe.attention.layer_norm_rms_epsilon", math.nan, "finite number > 0"),
        ("qwen3moe.attention.layer_norm_rms_epsilon", 0.0, "finite number > 0"),
        ("qwen3moe.attention.layer_norm_rms_epsilon", -1e-6, "finite number > 0"),
        ("qwen3moe.rope.freq_base", math.nan, "finite number > 0"),
        ("qwen3moe.rope.freq_base", 0.0, "finite number > 0"),
        ("qwen3moe.expert_weights_scale", math.nan, "finite number >= 0"),
        ("qwen3moe.expert_weights_scale", -1.0, "finite number >= 0"),
        ("qwen3moe.block_count", 1, "block_count is 1 but the file has tensors of 2 layers"),
        ("qwen3moe.expert_used_count", 9, "bad expert counts"),
        ("tokenizer.ggml.merges", None, "merges"),
    ],
)
def test_metadata_is_checked_at_load(model: Path, tmp_path: Path, key: str, value: object, words: str) -> None:
    where = layout(model)
    replaced = key if key in where.keys else "general.name"  # a key the writer left out replaces an unread one
    data = set_metadata(model.read_bytes(), where, replaced, value, as_key=key)
    with pytest.raises(ModelFileError, match=words) as error:
        _load(data, tmp_path)
    assert str(tmp_path) in str(error.value)
    if value is not None and not key.startswith("tokenizer"):
        assert key in str(error.value) or key.split(".", 1)[1] in str(error.value)


def test_a_header_declaring_more_tensors_than_the_architecture_has_fails_before_the_table(tmp_path: Path) -> None:
    """2^20 declared tensors cost gguf-py's table gigabytes; the count is checked against the layers
    (64 tensors per layer at most) before any tensor entry is parsed."""
    import gguf
    import numpy as np

    path = tmp_path / "many.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(2)
    for i in range(3000):
        writer.add_tensor(f"blk.0.t{i}", np.zeros(1, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelFileError, match=r"declares 3000 tensors, more than a qwen3moe model of 2 layers can have \(192\)"):
        GGUFFile.open(path)


def test_the_tensor_table_is_compact(tmp_path: Path) -> None:
    """As many tensors as the cap allows for 8 layers (576): gguf-py's table took ~5 KB per tensor
    (a ReaderField and a ReaderTensor of numpy views each), Strata's compact table under 1 KB with
    the TensorRefs (~0.85 KB measured, ~0.4 KB for the reader alone)."""
    import tracemalloc

    import gguf
    import numpy as np

    from strata_core.gguf.reader import MAX_GLOBAL_TENSORS, MAX_TENSORS_PER_LAYER, _open_reader

    path = tmp_path / "capped.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_block_count(8)
    n = MAX_TENSORS_PER_LAYER * 8 + MAX_GLOBAL_TENSORS
    for i in range(n):
        writer.add_tensor(f"blk.{i % 8}.ffn_gate_exps_with_a_longer_name_{i}.weight", np.zeros(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    GGUFFile.open(path)  # warm up imports and caches
    tracemalloc.start()
    try:
        opened = GGUFFile.open(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(opened.tensors) == n
    assert peak / n < 1024, f"{peak / n:.0f} bytes per tensor"
    # reader.tensors still gives gguf-py's ReaderTensor, built on demand, equal to gguf-py's own
    ours, theirs = _open_reader(str(path)).tensors, GGUFReader(path).tensors
    assert len(ours) == len(theirs) == n
    for a, b in [(ours[0], theirs[0]), (ours[-1], theirs[-1]), (ours[300], theirs[300])]:
        assert (a.name, a.tensor_type, a.shape.tolist(), a.n_bytes, a.data_offset, a.field.offset) == \
            (b.name, b.tensor_type, b.shape.tolist(), b.n_bytes, b.data_offset, b.field.offset)
        assert np.array_equal(a.data, b.data)


def test_the_compact_table_matches_gguf_py(model: Path) -> None:
    from strata_core.gguf.reader import _open_reader

    reader, plain = _open_reader(str(model)), GGUFReader(model)
    assert [row[0] for row in reader.table] == [t.name for t in plain.tensors]
    for (name, qtype, shape, offset, n_bytes), t in zip(reader.table, plain.tensors):
        assert (qtype, shape, offset, n_bytes) == \
            (t.tensor_type, tuple(int(d) for d in reversed(t.shape.tolist())), t.data_offset, t.n_bytes)
    assert reader.data_offset == plain.data_offset


def test_a_header_declaring_fewer_tensors_than_the_file_holds_is_refused(model: Path, tmp_path: Path) -> None:
    """One tensor fewer in the header's count: the data section would start inside the tensor table and
    every tensor would read shifted bytes. The data then ends well before the file: one error naming it."""
    data = model.read_bytes()
    count = int.from_bytes(data[8:16], "little")  # after the magic and the version: the tensor count
    with pytest.raises(ModelFileError, match=r"broken\.gguf: the tensor data ends at byte \d+, \d+ bytes before "
                                             r"the end of the file: the header declares fewer tensors"):
        _load(data[:8] + (count - 1).to_bytes(8, "little") + data[16:], tmp_path)
    _load(data, tmp_path)  # the file as written loads


def test_bytes_appended_after_the_tensor_data_are_refused(model: Path, tmp_path: Path) -> None:
    data = model.read_bytes()
    _load(data + b"\0" * (-len(data) % 32), tmp_path)  # the last tensor's alignment padding is allowed
    with pytest.raises(ModelFileError, match="something was appended"):
        _load(data + b"\0" * 4096, tmp_path)
