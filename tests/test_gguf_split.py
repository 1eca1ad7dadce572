"""Split GGUFs (``M-00001-of-00003.gguf``, as gguf-split writes them): opened from the first part,
every part memory-mapped, the same logits as the model in one file; and clear errors for bad splits."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from strata_core.engine import Engine
from strata_core.errors import ModelFileError
from strata_core.gguf.reader import GGUFFile


def split_copy(src: Path, out: Path, max_tensors: int) -> list[Path]:
    """Write ``src`` again as a split model with gguf-py's writer; returns the parts in order."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(out, str(reader.fields["general.architecture"].contents()),
                             split_max_tensors=max_tensors)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf"))


@pytest.fixture(scope="module")
def model(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory(expert_type="Q8_0")


@pytest.fixture(scope="module")
def parts(model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return split_copy(model, tmp_path_factory.mktemp("split") / "tiny.gguf", max_tensors=12)


def test_a_split_model_loads_from_its_first_part(model: Path, parts: list[Path], one_thread: None) -> None:
    assert len(parts) >= 3 and parts[0].name.endswith("-00001-of-%05d.gguf" % len(parts))
    opened = GGUFFile.open(parts[0])
    assert opened.parts == tuple(str(p) for p in parts)
    assert {ref.path for ref in opened.tensors.values()} == {str(p) for p in parts}
    assert opened.tensors.keys() == GGUFFile.open(model).tensors.keys()
    want = Engine.load(model, devices=["cpu"], max_context=16)
    got = Engine.load(parts[0], devices=["cpu"], max_context=16)
    try:
        assert torch.equal(got.logits([1, 2, 3]), want.logits([1, 2, 3]))
    finally:
        want.close()
        got.close()


def test_a_later_part_names_the_first(parts: list[Path]) -> None:
    with pytest.raises(ModelFileError, match=f"part 2 of {len(parts)}.*pass the first part.*{parts[0].name}"):
        GGUFFile.open(parts[1])


def test_a_missing_part_is_named(parts: list[Path], tmp_path: Path) -> None:
    for p in parts:
        (tmp_path / p.name).write_bytes(p.read_bytes())
    (tmp_path / parts[-1].name).unlink()
    with pytest.raises(ModelFileError, match=f"{parts[-1].name}: no such GGUF file"):
        GGUFFile.open(tmp_path / parts[0].name)


def test_a_renamed_first_part_is_an_error(parts: list[Path], tmp_path: Path) -> None:
    renamed = tmp_path / "model.gguf"
    renamed.write_bytes(parts[0].read_bytes())
    with pytest.raises(ModelFileError, match="-NNNNN-of-NNNNN.gguf"):
        GGUFFile.open(renamed)
