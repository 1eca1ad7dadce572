"""Property tests of the residency table: one owner per slot, mask/restore round trip, mirror in sync."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_core.errors import ConfigError
from strata_core.experts.table import ResidencyTable

L, E = 3, 5

ops = st.lists(
    st.tuples(st.sampled_from(["assign", "evict", "mask", "restore"]),
              st.integers(0, L - 1), st.integers(0, E - 1),
              st.lists(st.tuples(st.integers(0, L - 1), st.integers(0, E - 1)), max_size=6)),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(n_slots=st.integers(0, 8), sequence=ops)
def test_random_sequences_keep_invariants(n_slots, sequence):
    table = ResidencyTable(L, E, n_slots)
    records = []
    for op, layer, expert, entries in sequence:
        try:
            if op == "assign":
                slot = table.take_free_slot()
                if slot is not None:
                    table.assign(layer, expert, slot)
            elif op == "evict":
                table.evict(layer, expert)
            elif op == "mask":
                records.append(table.mask(entries))
            elif records:
                table.restore(records.pop())
        except ConfigError:
            pass  # refused changes (already resident, masked, not resident) must leave the table intact
        table.check()
    while records:
        table.restore(records.pop())
    table.check()
    assert not table.masked.any()


@settings(max_examples=40, deadline=None)
@given(fill=st.lists(st.tuples(st.integers(0, L - 1), st.integers(0, E - 1)), unique=True, max_size=L * E),
       masks=st.lists(st.lists(st.tuples(st.integers(0, L - 1), st.integers(0, E - 1)), max_size=8), max_size=4))
def test_mask_then_restore_gives_back_the_same_table(fill, masks):
    table = ResidencyTable(L, E, len(fill))
    with table.batch():
        for layer, expert in fill:
            table.assign(layer, expert, table.take_free_slot())
    before = table.host.clone()
    records = [table.mask(entries) for entries in masks]
    for record in records:
        for layer, expert in record.entries.tolist():
            assert table.slot(layer, expert) == -1  # compute sees nothing of a masked entry
    for record in reversed(records):
        table.restore(record)
    assert torch.equal(table.host, before)
    table.check()


def test_refusals_name_the_problem():
    table = ResidencyTable(L, E, 2)
    table.assign(0, 1, 0)
    with pytest.raises(ConfigError, match="already in slot 0"):
        table.assign(0, 1, 1)
    with pytest.raises(ConfigError, match="slot 0 .* not free"):
        table.assign(1, 1, 0)
    record = table.mask([(0, 1)])
    with pytest.raises(ConfigError, match="masked"):
        table.evict(0, 1)
    table.restore(record)
    with pytest.raises(ConfigError, match="restore"):
        table.restore(record)
    assert table.evict(0, 1) == 0
    with pytest.raises(ConfigError, match="not resident"):
        table.evict(0, 1)
    table.check()


def test_batch_publishes_once_at_the_end():
    table = ResidencyTable(L, E, 4)
    with table.batch():
        table.assign(2, 3, table.take_free_slot())
        assert table.mirror[2, 3] == -1  # not yet published
    assert table.mirror[2, 3] == 0
