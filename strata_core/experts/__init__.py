"""Expert residency: the host arena, device caches, residency tables, usage profile, streaming."""
