"""The architecture registry: GGUF ``general.architecture`` name -> ``Architecture`` (its metadata
reader, its tensors through its ModelSpec, its forward), and the loaders that go through it.

Adding an architecture = a module (or package) defining ``ARCH`` + one line in ``_MODULES``.
"""

from __future__ import annotations

import torch

from strata_core.config import StrataSettings
from strata_core.errors import UnsupportedError
from strata_core.gguf.reader import GGUFFile
from strata_core.model import qwen2moe, qwen3moe
from strata_core.model.architecture import Architecture
from strata_core.model.deepseek2 import architecture as deepseek2
from strata_core.model.gpt_oss import architecture as gpt_oss
from strata_core.model.qwen3next import architecture as qwen3next
from strata_core.model.spec import ModelSpec
from strata_core.model.transformer import MoEModel
from strata_core.model.weights import DenseWeights
from strata_core.text.vocab import check_tokenizer_metadata

__all__ = ["Architecture", "ARCHITECTURES", "get_architecture", "load_model", "load_model_spec"]

_MODULES = (qwen3moe, qwen2moe, gpt_oss, qwen3next, deepseek2)

ARCHITECTURES: dict[str, Architecture] = {m.ARCH.name: m.ARCH for m in _MODULES}


def get_architecture(name: str, path: str = "") -> Architecture:
    """The registered Architecture ``name``; UnsupportedError listing the supported ones otherwise."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        where = f"{path}: " if path else ""
        raise UnsupportedError(f"{where}architecture {name!r} is not supported "
                               f"(supported: {', '.join(sorted(ARCHITECTURES))})") from None


def load_model_spec(gguf_file: GGUFFile) -> ModelSpec:
    """The ``ModelSpec`` of an opened ``GGUFFile``; validates every tensor the forward will read.

    Raises UnsupportedError for an unknown architecture, ModelFileError for missing or ill-typed
    keys, missing or misshapen tensors, and broken tokenizer keys.
    """
    arch = get_architecture(gguf_file.architecture, gguf_file.path)
    spec = arch.spec_from_metadata(gguf_file.metadata, gguf_file.tensors, gguf_file.path)
    arch.validate(gguf_file, spec)
    check_tokenizer_metadata(gguf_file.metadata, gguf_file.path, spec.vocab_size)
    return spec


def load_model(gguf_file: GGUFFile, dtype: torch.dtype = torch.float32,
               settings: StrataSettings | None = None) -> MoEModel:
    """Read the spec and dequantize the dense weights of ``gguf_file`` (CPU): the forward of the
    file's architecture (``Architecture.model``) with the kernels ``settings`` choose."""
    spec = load_model_spec(gguf_file)
    return get_architecture(spec.architecture).model(spec, DenseWeights.load(gguf_file, spec, dtype), settings)
