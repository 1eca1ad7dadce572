"""``freeze_loaded``: the objects alive at the call leave the collector's generations."""

import gc

from strata_core.runtime.heap import freeze_loaded


def test_objects_alive_at_the_call_are_frozen_and_later_ones_are_not():
    before = [object()]  # a tracked container
    try:
        assert freeze_loaded() >= 1
        after = [object()]
        tracked = gc.get_objects()
        assert not any(o is before for o in tracked), "an object alive at the call is still collected"
        assert any(o is after for o in tracked)
    finally:
        gc.unfreeze()
