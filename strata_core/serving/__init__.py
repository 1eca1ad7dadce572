"""Serving: requests from HTTP (or the CLI) turned into engine work and back into text.

- ``scheduler.py``: the queue and the loop of steps that ties the parts below together.
- ``step_plan.py``: what a step runs: every decoding slot's token and prompt chunks under ``--step-tokens``.
- ``slots.py``: the generation slots and their sessions (prefix reuse, the conversation cache).
- ``streams.py``: a request's sampled tokens turned into text, stop strings and its finish reason.
- ``compute_thread.py``: the one long-lived thread that makes every torch call (load, steps, release).
- ``requests.py``: a request's parameters and its stream of events.
- ``sampling.py``: logits to token ids (temperature, top-k/p, min-p, penalties, logit bias, seeds).
- ``stop_strings.py``: stop strings matched across token boundaries.
- ``conv_cache.py``: displaced conversations' KV kept in host RAM for their return.
- ``server/``: the OpenAI-compatible Litestar app (schemas, controllers, errors, metrics, loading).

The scheduler only schedules; the engine (and its runner) computes; the service turns token ids into
text and events. One request's failure ends only that request.
"""
