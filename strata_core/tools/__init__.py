"""Tools around the engine: ``bench.py`` (``strata bench``: prefill and decode figures), ``bench_serve.py``
(``strata bench serve``: concurrent streaming clients against any OpenAI-compatible server; TTFT,
inter-token latency, tok/s), ``gate.py``
(``strata gate``: every strategy's greedy output against ``single``'s), ``synthetic.py`` (``strata
make-synthetic``: models of real shapes from the architectures' presets)."""
