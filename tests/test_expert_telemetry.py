"""The expert counters' timing events: each pair is resolved once and folded into the totals, so a
reader that snapshots after every step (the server) pays for the new events only."""

from __future__ import annotations

from strata_core.experts.telemetry import ExpertTelemetry


class CountingEvent:
    """A stand-in for a recorded ``torch.cuda.Event`` pair's end: counts how often it is resolved."""

    resolved = 0

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: CountingEvent) -> float:
        CountingEvent.resolved += 1
        return 250.0  # milliseconds


def test_each_timing_event_is_resolved_once_and_its_seconds_stay_counted():
    telemetry = ExpertTelemetry()
    for _ in range(3):
        telemetry.add_copy_events(1_000_000, CountingEvent(), CountingEvent())
    first = telemetry.snapshot()
    assert first["copy_s"] == 0.75 and first["bytes_streamed"] == 3_000_000 and CountingEvent.resolved == 3
    second = telemetry.snapshot()
    assert second["copy_s"] == 0.75 and CountingEvent.resolved == 3  # nothing resolved again
    telemetry.add_copy_events(1_000_000, CountingEvent(), CountingEvent())
    assert telemetry.snapshot()["copy_s"] == 1.0 and CountingEvent.resolved == 4
    assert telemetry.delta(first)["copy_s"] == 0.25
