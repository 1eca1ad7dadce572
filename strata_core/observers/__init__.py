"""Observer plugins that wrap the phase hooks under any strategy (timing, NaN guard)."""
