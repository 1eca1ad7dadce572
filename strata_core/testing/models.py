"""Tiny model files for tests: a seeded random qwen3moe/qwen2moe with a small byte-level BPE.

The weights come from :func:`strata_core.gguf.tiny.tiny_hf_model` (non-degenerate routing), the
tokenizer is trained on a fixed paragraph, and the file is written with the llama.cpp layout by
:func:`strata_core.gguf.writer.write_gguf`. Everything is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gguf import GGMLQuantizationType

from strata_core.gguf.reader import GGUFFile
from strata_core.gguf.tiny import tiny_hf_model
from strata_core.gguf.writer import write_gguf
from strata_core.model.registry import load_model_spec
from strata_core.model.spec import ModelSpec
from strata_core.text.chat import CHATML_TEMPLATE
from strata_core.text.tokenizer import train_byte_level_bpe

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_TEXT = (
    "In the beginning the engine loaded the model, and the experts lived in host memory. "
    "The hot experts were cached on the device, and the cold ones streamed over the link. "
    "Every token was routed to a few experts; their rows were summed in one fixed order. "
) * 4


@dataclass(frozen=True)
class TinyModelOptions:
    """Sizes and block types of a tiny test model (see :func:`strata_core.gguf.tiny.tiny_config`)."""

    architecture: str = "qwen3moe"
    expert_type: str = "F32"
    dense_type: str = "F32"
    n_layers: int = 2
    n_experts: int = 8
    n_experts_used: int = 2
    vocab_size: int = 320
    seed: int = 0


def write_tiny_model(path: Path, options: TinyModelOptions) -> Path:
    """Write the tiny model described by ``options`` to ``path``; returns ``path``."""
    tokenizer = train_byte_level_bpe([TOKENIZER_TEXT], vocab_size=options.vocab_size,
                                     special_tokens=SPECIAL_TOKENS)
    model = tiny_hf_model(options.architecture, seed=options.seed, vocab_size=options.vocab_size,
                          num_hidden_layers=options.n_layers, num_experts=options.n_experts,
                          num_experts_per_tok=options.n_experts_used)
    write_gguf(model, path, expert_qtype=GGMLQuantizationType[options.expert_type],
               dense_qtype=GGMLQuantizationType[options.dense_type],
               tokenizer=tokenizer, chat_template=CHATML_TEMPLATE)
    return path


def tiny_spec(path: Path) -> ModelSpec:
    """The ``ModelSpec`` of a model file (a tiny one from ``tiny_model_factory``, say): what
    ``strata_topology`` receives as ``spec``, for testing a placement function without an engine."""
    return load_model_spec(GGUFFile.open(path))
