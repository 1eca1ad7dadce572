"""Models: one module or package per architecture and the shared forward they build on.

- ``spec.py``: ``ModelSpec``, the numbers and tensors of a model; ``metadata.py``: typed GGUF key
  reads; ``architecture.py``: ``Architecture``, metadata -> spec, the checks, the forward it builds;
  ``registry.py``: ``general.architecture`` -> ``Architecture``, ``load_model_spec``, ``load_model``.
- The shared Qwen-style MoE forward: ``transformer.py`` (``MoEModel``), ``ops.py``, ``rope.py``,
  ``kvcache.py`` (``KVCache``), ``kvtransfer.py`` (its hand-offs and host snapshots, ``KVSnapshot``),
  ``weights.py`` (``DenseWeights``), ``head_split.py``, ``fused_decode.py``; ``preset.py``: ``Preset``,
  the base of the synthetic presets.
- An architecture: ``qwen3moe.py``, ``qwen2moe.py`` (the shared forward, other flags), and
  ``gpt_oss/``, ``deepseek2/``, ``qwen3next/``, each with ``spec.py`` (its ModelSpec: numbers,
  state, tensors), ``architecture.py`` (llama.cpp's reading of its metadata, ``ARCH``),
  ``forward.py`` (its ``MoEModel`` subclass) and ``preset.py`` (its synthetic shapes).

Nothing here is imported by this package's ``__init__``: import the module that holds a name.
"""
