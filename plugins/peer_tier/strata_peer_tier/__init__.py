"""The ``peer_tier`` topology plugin for Strata (entry point: :mod:`strata_peer_tier.plugin`)."""
