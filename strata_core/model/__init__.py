"""The dense forward (``MoEModel``), its weights (``DenseWeights``) and the KV cache (``KVCache``)."""

from strata_core.model.kvcache import KVCache, KVSnapshot
from strata_core.model.transformer import MoEModel
from strata_core.model.weights import DenseWeights

__all__ = ["DenseWeights", "KVCache", "KVSnapshot", "MoEModel"]
