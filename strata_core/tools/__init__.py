"""Tools around the engine:

- ``bench.py``: ``strata bench``, prefill and decode figures;
- ``bench_serve.py``: ``strata bench serve``, concurrent streaming clients against any OpenAI-compatible
  server; ``serve_report.py`` its figures (TTFT, inter-token latency, tok/s) and tables;
  ``serve_launcher.py`` the ``strata serve`` it starts when no ``--url`` is given;
- ``gate.py``: ``strata gate``, every strategy's greedy output against ``single``'s;
- ``synthetic.py``: ``strata make-synthetic``, models of real shapes from the architectures' presets.
"""
