"""Test-suite settings: hypothesis runs derandomized (CI sees the same examples every run) and
without per-example deadlines (a shared 2-core machine is slow in bursts)."""

import pytest
import torch
from hypothesis import settings

settings.register_profile("strata", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("strata")


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny matmuls: on an oversubscribed 2-core box OpenMP
    spinning costs ~40 ms per product with 2 threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory):
    """A 2-layer, 16-expert, top-4 Q4_K model (hidden 256, expert FFN 256) and its reference rows."""
    from gguf import GGMLQuantizationType as Q

    from strata_core.experts.rows import DequantExpertRows
    from strata_core.experts.weights import ExpertWeights
    from strata_core.gguf.reader import GGUFFile
    from strata_core.model.registry import load_model_spec
    from strata_core.tools.synthetic import PRESETS, write_synthetic

    path = tmp_path_factory.mktemp("synthetic") / "tiny-q4k.gguf"
    write_synthetic(path, PRESETS["tiny"], expert_type=Q.Q4_K, dense_type=Q.Q8_0, progress=False)
    gguf_file = GGUFFile.open(path)
    spec = load_model_spec(gguf_file)
    weights = ExpertWeights(gguf_file, spec)
    return weights, spec, DequantExpertRows(weights)
