"""Tokenizer from GGUF metadata: llama.cpp's keys, same ids as the source tokenizer, streaming decode."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from strata_core.errors import ModelFileError, UnsupportedError
from strata_core.gguf.reader import GGUFFile
from strata_core.text.tokenizer_meta import add_tokenizer_metadata
from strata_core.text.tokenizer import Tokenizer, train_byte_level_bpe

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "In the beginning God created the heaven and the earth. And the earth was without form, and void.",
    "The quick brown fox jumps over the lazy dog; don't stop, we'll see, I'm here, they've gone.",
    "Ünïcödé text: naïve café, Straße, Αθήνα, Москва, 東京, 你好世界, 🚀🦙✅ emojis 1234567890.",
    "    indented code\n\tdef f(x):\n\t\treturn x ** 2  # comment\n\n\n",
]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.fixture(scope="module")
def source() -> tokenizers.Tokenizer:
    tok = train_byte_level_bpe(CORPUS * 20, vocab_size=600, special_tokens=SPECIAL)
    tok.add_tokens([tokenizers.AddedToken("<think>", special=False, normalized=False)])
    return tok


def _write(path: Path, tok: tokenizers.Tokenizer, **kwargs: object) -> Path:
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    add_tokenizer_metadata(writer, tok, TEMPLATE, **{"bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>", **kwargs})
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_path(source: tokenizers.Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("tok") / "tok.gguf", source)


@pytest.fixture(scope="module")
def tokenizer(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile.open(gguf_path).metadata)


def test_metadata_keys_match_llama_cpp(gguf_path: Path, source: tokenizers.Tokenizer, tmp_path: Path) -> None:
    """The keys gguf-py's SpecialVocab (what convert_hf_to_gguf.py uses) writes from tokenizer.json + config."""
    meta = GGUFFile.open(gguf_path).metadata
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "qwen2"
    vocab = source.get_vocab(with_added_tokens=True)
    assert meta["tokenizer.ggml.tokens"] == sorted(vocab, key=vocab.get)
    types = dict(zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]))
    assert {types[t] for t in SPECIAL} == {gguf.TokenType.CONTROL}
    assert types["<think>"] == gguf.TokenType.USER_DEFINED
    assert types["a"] == gguf.TokenType.NORMAL
    assert meta["tokenizer.chat_template"] == TEMPLATE

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    source.save(str(hf_dir / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": TEMPLATE}
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    reference = gguf.GGUFWriter(str(tmp_path / "ref.gguf"), "qwen3moe")
    gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=len(vocab)).add_to_gguf(reference, quiet=True)
    for key, field in reference.kv_data[0].items():
        assert meta[key] == field.value, key


def test_vocab_size_pads_with_unused_tokens(source: tokenizers.Tokenizer, tmp_path: Path) -> None:
    n = source.get_vocab_size() + 5
    meta = GGUFFile.open(_write(tmp_path / "padded.gguf", source, vocab_size=n)).metadata
    assert meta["tokenizer.ggml.tokens"][-1] == f"[PAD{n - 1}]"
    assert meta["tokenizer.ggml.token_type"][-5:] == [gguf.TokenType.UNUSED] * 5
    tok = Tokenizer.from_gguf(meta)
    assert tok.vocab_size == n
    assert tok.encode("the earth") == source.encode("the earth").ids


def test_special_ids(tokenizer: Tokenizer, source: tokenizers.Tokenizer) -> None:
    assert tokenizer.bos_token_id is None
    assert tokenizer.eos_token_ids == {source.token_to_id("<|im_end|>"), source.token_to_id("<|endoftext|>")}
    assert tokenizer.vocab_size == source.get_vocab_size()


def test_add_bos(source: tokenizers.Tokenizer, tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(_write(tmp_path / "bos.gguf", source, bos="<|endoftext|>", add_bos=True))
    bos = source.token_to_id("<|endoftext|>")
    assert tok.encode("hi") == [bos, *source.encode("hi").ids]
    assert tok.encode("hi", add_special_tokens=False) == source.encode("hi").ids


def test_chat_text_keeps_special_tokens_whole(tokenizer: Tokenizer, source: tokenizers.Tokenizer) -> None:
    text = "<|im_start|>user\n<think>Hello</think><|im_end|>\n"
    ids = tokenizer.encode(text)
    assert ids == source.encode(text).ids
    assert ids[0] == source.token_to_id("<|im_start|>")
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert tokenizer.decode(ids) == "user\n<think>Hello</think>\n"


texts = st.one_of(
    st.text(max_size=200),
    st.lists(st.sampled_from(" ".join(CORPUS).split(" ") + [" ", "\n", "  ", "\t"]), max_size=40).map(" ".join),
)


@settings(max_examples=200, deadline=None)
@given(text=texts)
def test_round_trip_matches_source(tokenizer: Tokenizer, source: tokenizers.Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids == source.encode(text).ids
    assert tokenizer.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(text=texts)
def test_stream_decoder_equals_full_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    stream = tokenizer.stream_decoder()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


def test_stream_decoder_holds_back_partial_characters(tokenizer: Tokenizer) -> None:
    # A single-byte token that is the first byte of a 4-byte emoji cannot be shown yet.
    ids = tokenizer.backend.encode("\U0001f999", add_special_tokens=False).ids  # an emoji not in the corpus
    assert len(ids) > 1
    stream = tokenizer.stream_decoder()
    assert [stream.push(i) for i in ids] == [""] * (len(ids) - 1) + ["\U0001f999"]
    stream.push(ids[0])
    assert stream.flush() == "\ufffd"


def test_from_path(gguf_path: Path, tokenizer: Tokenizer) -> None:
    assert Tokenizer.from_gguf(gguf_path).encode("the earth") == tokenizer.encode("the earth")


def test_bad_metadata() -> None:
    with pytest.raises(ModelFileError, match="no tokenizer"):
        Tokenizer.from_gguf({"general.architecture": "qwen3moe"})
    with pytest.raises(UnsupportedError, match="'llama'"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})


@pytest.mark.parametrize("name", ["demo-qwen3moe-f16.gguf", "demo-qwen3moe-q8_0.gguf"])
def test_demo_model_tokenizer(name: str) -> None:
    path = Path(__file__).parents[1] / "strata_core" / "data" / name
    tok = Tokenizer.from_gguf(path)
    assert tok.vocab_size == 2048
    assert tok.bos_token_id is None
    assert tok.eos_token_ids == {0, 2}  # <|endoftext|>, <|im_end|>
    text = "<|im_start|>user\nAnd the LORD said unto Moses, Go.<|im_end|>\n"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids[-2] == 2
    assert len(ids) < len(text) // 2  # the BPE learned the corpus' words
    assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize(("architecture", "converter"), [("qwen3moe", "qwen3_moe"), ("deepseek2", "gpt2"),
                                                         ("gpt-oss", "gpt2")])
def test_older_transformers_convert_any_architecture(architecture: str, converter: str, monkeypatch) -> None:
    """Before 5.20 transformers keyed its GGUF tokenizer converters by HF model type and knew no
    deepseek2 or gpt-oss: those take the generic byte-level BPE converter instead of failing."""
    import sys
    import types

    from strata_core.text import tokenizer as module

    asked = []
    ggml = types.ModuleType("transformers.integrations.ggml")
    ggml.GGUF_TO_FAST_CONVERTERS = {"qwen3_moe": object, "gpt2": object}
    ggml.convert_gguf_tokenizer = lambda arch, spec: asked.append(arch) or ("backend", {})
    monkeypatch.setitem(sys.modules, "transformers.integrations.gguf", None)  # import fails as on 4.x
    monkeypatch.setitem(sys.modules, "transformers.integrations.ggml", ggml)
    assert module._convert_gguf_tokenizer(architecture, {}) == ("backend", {}) and asked == [converter]
