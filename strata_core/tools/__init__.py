"""Tools around the engine: ``bench.py`` (``strata bench``: prefill and decode figures), ``gate.py``
(``strata gate``: every strategy's greedy output against ``single``'s), ``synthetic.py`` (``strata
make-synthetic``: models of real shapes from the architectures' presets)."""
