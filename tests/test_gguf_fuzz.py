"""Fuzzing the loader: a corrupted GGUF (header bytes, integer fields of the header and tensor infos,
metadata values, truncation) ends in a clear error naming the file, or loads a model whose logits
are finite. Nothing else: no traceback from deep inside, no hang, no memory blow-up, no NaN."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf_corrupt import Layout, layout, set_bytes, set_int, set_metadata, truncate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_core.engine import Engine
from strata_core.errors import StrataError

_names = itertools.count()

#: integers that break readers: zero, small, sign and width edges, huge
INTERESTING = [0, 1, 2, 3, 7, 31, 33, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**60, 2**63,
               2**64 - 1]
#: metadata values of the wrong type or range (None drops the key)
BAD_VALUES = [None, 0, -1, 1, 2, 3, 7, 2**40, "12", "", 1e-30, 1e30, math.nan, math.inf, -2.5, True, [1, 2], [],
              ["a"]]


class Original(tuple):
    """(file bytes, layout, scratch folder), shown briefly in hypothesis' reports."""

    def __repr__(self) -> str:
        return f"<tiny model, {len(self[0])} bytes>"


@pytest.fixture(scope="module")
def original(tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory,
             one_thread: None) -> tuple[bytes, Layout, Path]:
    path = tiny_model_factory(expert_type="Q8_0")
    return Original((path.read_bytes(), layout(path), tmp_path_factory.mktemp("fuzz")))


def outcome(data: bytes, folder: Path) -> str:
    """Load ``data`` as a model file: "error" (a clear one) or "loaded" (finite logits); else fail."""
    path = folder / f"corrupt-{next(_names)}.gguf"
    path.write_bytes(data)
    try:
        engine = Engine.load(path, devices=["cpu"], max_context=16)
    except StrataError as error:
        assert str(path) in str(error), f"the error does not name the file: {error}"
        return "error"
    finally:
        path.unlink()  # the mapping (if any) stays valid
    try:
        logits = engine.logits(list(range(min(3, engine.max_context))))
    finally:
        engine.close()
    assert torch.isfinite(logits).all(), "the model loaded but its logits are not finite"
    return "loaded"


FUZZ = settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(st.data())
def test_integer_fields_of_header_and_tensor_infos(original: tuple[bytes, Layout, Path], data: st.DataObject) -> None:
    raw, where, folder = original
    slot = data.draw(st.sampled_from(where.slots) | st.sampled_from(where.tensor_slots), label="slot")
    old = int.from_bytes(raw[slot[0] : slot[0] + slot[1]], "little")
    value = data.draw(st.one_of(st.sampled_from(INTERESTING), st.integers(-64, 64).map(lambda d: old + d)), "value")
    outcome(set_int(raw, slot, value), folder)


@FUZZ
@given(st.data())
def test_metadata_values(original: tuple[bytes, Layout, Path], data: st.DataObject) -> None:
    raw, where, folder = original
    key = data.draw(st.sampled_from(sorted(where.keys)), label="key")
    value = data.draw(st.sampled_from(BAD_VALUES), label="value")
    outcome(set_metadata(raw, where, key, value), folder)


@FUZZ
@given(st.data())
def test_header_bytes(original: tuple[bytes, Layout, Path], data: st.DataObject) -> None:
    raw, where, folder = original
    changes = data.draw(st.lists(st.tuples(st.integers(0, where.header_end - 1), st.integers(0, 255)),
                                 min_size=1, max_size=4), label="changes")
    outcome(set_bytes(raw, changes), folder)


@settings(max_examples=25)
@given(st.data())
def test_truncation(original: tuple[bytes, Layout, Path], data: st.DataObject) -> None:
    raw, where, folder = original
    length = data.draw(st.one_of(st.integers(0, where.header_end), st.integers(0, len(raw) - 1)), label="length")
    assert outcome(truncate(raw, length), folder) == "error"


def test_the_untouched_file_loads(original: tuple[bytes, Layout, Path]) -> None:
    raw, _, folder = original
    assert outcome(raw, folder) == "loaded"
