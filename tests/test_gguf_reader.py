"""GGUFFile / TensorRef: zero-copy views, torch-order shapes, and clear errors for broken files."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from strata_core.errors import ModelFileError, UnsupportedError
from strata_core.gguf.reader import GGUFFile
from strata_core.model.registry import load_model_spec
from strata_core.gguf.tiny import tiny_hf_model
from strata_core.gguf.writer import write_gguf


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("reader") / "tiny.gguf"
    write_gguf(tiny_hf_model("qwen3moe", seed=1), path, expert_qtype=gguf.GGMLQuantizationType.Q8_0)
    return path


def rewrite(src: Path, dst: Path, arch: str | None = None, drop_keys: tuple[str, ...] = (),
            drop_tensors: tuple[str, ...] = (), replace: dict[str, np.ndarray] | None = None) -> Path:
    """Copy a GGUF file with metadata keys / tensors dropped or replaced (F32 tensors only)."""
    f = GGUFFile.open(src)
    w = gguf.GGUFWriter(str(dst), arch or f.architecture)
    for key, value in f.metadata.items():
        if key in drop_keys or key == "general.architecture":
            continue
        if key.startswith(f"{f.architecture}.") and arch:
            key = f"{arch}." + key.split(".", 1)[1]
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, value)
    for name, ref in f.tensors.items():
        if name in drop_tensors:
            continue
        if replace and name in replace:
            w.add_tensor(name, replace[name])
        else:
            byte_shape = ref.data.shape[0] // int(np.prod(ref.shape[:-1]))
            w.add_tensor(name, np.asarray(ref.data).reshape(*ref.shape[:-1], byte_shape), raw_dtype=ref.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_metadata_and_torch_order_shapes(good):
    f = GGUFFile.open(good)
    assert f.architecture == "qwen3moe"
    assert f.metadata["qwen3moe.block_count"] == 2
    assert f.metadata["qwen3moe.expert_weights_norm"] is True
    gate = f.tensors["blk.0.ffn_gate_exps.weight"]
    assert gate.shape == (8, 32, 64)  # (n_expert, n_ff_exp, n_embd)
    assert f.tensors["blk.0.ffn_down_exps.weight"].shape == (8, 64, 32)
    assert gate.qtype == gguf.GGMLQuantizationType.Q8_0
    assert gate.nbytes == 8 * 32 * (64 // 32) * 34


def test_tensor_data_is_a_zero_copy_memmap(good):
    f = GGUFFile.open(good)
    ref = f.tensors["blk.1.ffn_up_exps.weight"]
    assert isinstance(ref.data, np.memmap)  # a view of the mapped file, not an in-RAM copy
    assert ref.data.dtype == np.uint8 and ref.data.ndim == 1
    raw = ref.raw()
    assert raw.dtype == torch.uint8 and raw.data_ptr() == ref.data.ctypes.data
    per = ref.nbytes // 8
    e3 = ref.expert_raw(3)
    assert e3.numel() == per and e3.data_ptr() == ref.data.ctypes.data + 3 * per
    assert bytes(e3[:34].numpy()) == bytes(np.asarray(ref.data[3 * per:3 * per + 34]))


def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError, match="no such GGUF file") as e:
        GGUFFile.open(tmp_path / "nope.gguf")
    assert str(tmp_path / "nope.gguf") in str(e.value)


def test_garbage_bytes(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"\x89PNG\r\n" + bytes(range(200)))
    with pytest.raises(ModelFileError, match="not a GGUF file") as e:
        GGUFFile.open(bad)
    assert str(bad) in str(e.value)


@pytest.mark.parametrize("keep", [10, 200, 0.5, 0.999])
def test_truncated_file(good, tmp_path, keep):
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(ModelFileError) as e:
        GGUFFile.open(cut)
    assert str(cut) in str(e.value)
    if isinstance(keep, float):  # header intact, tensor data cut: names the tensor
        assert "data runs past the end of the file" in str(e.value) and "tensor '" in str(e.value)


def test_missing_tensor(good, tmp_path):
    bad = rewrite(good, tmp_path / "missing.gguf", drop_tensors=("blk.1.attn_k_norm.weight",))
    with pytest.raises(ModelFileError, match="'blk.1.attn_k_norm.weight' is missing") as e:
        load_model_spec(GGUFFile.open(bad))
    assert str(bad) in str(e.value)


def test_wrong_shape(good, tmp_path):
    bad = rewrite(good, tmp_path / "shape.gguf",
                  replace={"blk.0.attn_q.weight": np.zeros((64, 48), np.float32)})
    with pytest.raises(ModelFileError, match=r"'blk.0.attn_q.weight' has shape \(64, 48\), expected \(128, 64\)") as e:
        load_model_spec(GGUFFile.open(bad))
    assert str(bad) in str(e.value)


def test_missing_metadata_key(good, tmp_path):
    bad = rewrite(good, tmp_path / "nokey.gguf", drop_keys=("qwen3moe.expert_count",))
    with pytest.raises(ModelFileError, match="'qwen3moe.expert_count' is missing"):
        load_model_spec(GGUFFile.open(bad))


def test_unknown_architecture(good, tmp_path):
    bad = rewrite(good, tmp_path / "arch.gguf", arch="mamba9")
    with pytest.raises(UnsupportedError, match="'mamba9' is not supported.*qwen2moe, qwen3moe") as e:
        load_model_spec(GGUFFile.open(bad))
    assert str(bad) in str(e.value)


def test_unsupported_block_type(good, tmp_path, monkeypatch):
    import strata_core.gguf.reader as reader

    monkeypatch.setattr(reader, "SUPPORTED_TYPES", reader.SUPPORTED_TYPES - {gguf.GGMLQuantizationType.Q8_0})
    with pytest.raises(UnsupportedError, match="'blk.0.ffn_gate_exps.weight' uses block type Q8_0") as e:
        load_model_spec(GGUFFile.open(good))
    assert str(good) in str(e.value)


def test_unknown_block_type_id(good, tmp_path):
    f = GGUFFile.open(good)
    data = bytearray(good.read_bytes())
    # the tensor-info record of the first tensor: name, n_dims, dims, then the type id (u32)
    name = next(iter(f.tensors)).encode()
    pos = data.index(name) + len(name)
    n_dims = int.from_bytes(data[pos:pos + 4], "little")
    type_pos = pos + 4 + 8 * n_dims
    data[type_pos:type_pos + 4] = (250).to_bytes(4, "little")
    bad = tmp_path / "type.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(UnsupportedError, match=f"{name.decode()!r} has unknown block type id 250") as e:
        GGUFFile.open(bad)
    assert str(bad) in str(e.value)


DEMO = Path(__file__).parent.parent / "strata_core" / "data" / "demo-qwen3moe-q8_0.gguf"  # with a tokenizer


def test_metadata_arrays_read_as_gguf_py_reads_them():
    """Arrays of strings and of numbers (read in one pass, not item by item) give what gguf-py's own
    reader gives: the vocabulary, token types, scores and merges of the tokenizer, every key."""
    ours = GGUFFile.open(DEMO).metadata
    theirs = {name: field.contents() for name, field in gguf.GGUFReader(DEMO).fields.items()
              if not name.startswith("GGUF.")}
    assert ours.keys() == theirs.keys() and isinstance(ours["tokenizer.ggml.tokens"], list)
    for key, value in theirs.items():
        assert ours[key] == value, key


@pytest.mark.parametrize("into", [0.25, 0.5, 0.9])
def test_a_file_cut_inside_the_vocabulary_is_a_clear_error(tmp_path, into):
    reader = gguf.GGUFReader(DEMO)
    field = reader.fields["tokenizer.ggml.tokens"]
    start, end = field.offset, field.offset + sum(int(p.nbytes) for p in field.parts)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(DEMO.read_bytes()[:int(start + into * (end - start))])
    with pytest.raises(ModelFileError, match="truncated or corrupt|more than the file could hold"):
        GGUFFile.open(cut)
