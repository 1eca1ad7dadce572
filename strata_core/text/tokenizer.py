"""The tokenizer a GGUF describes: encode, decode, and stream-decode token ids.

The vocabulary, merges and special tokens are read from the GGUF metadata (llama.cpp's
``tokenizer.ggml.*`` keys) and rebuilt with transformers' GGUF tokenizer conversion
(``transformers.integrations.gguf.convert_gguf_tokenizer``), which also picks the pre-tokenizer
regex named by ``tokenizer.ggml.pre``. No weights are read. Like llama.cpp, text is not
unicode-normalized before splitting.

``train_byte_level_bpe`` builds a small Qwen2-style tokenizer for tests and the demo model.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping
from typing import Any

import gguf
import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers

from strata_core.errors import ModelFileError, UnsupportedError
from strata_core.gguf.reader import GGUFFile

__all__ = ["StreamDecoder", "Tokenizer", "token_bytes", "train_byte_level_bpe"]

# Texts llama.cpp treats as end-of-generation whatever the file says (llama-vocab.cpp, special_eog_ids).
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
        "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
        "<end_of_utterance>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
    }
)  # fmt: skip



def _harmony_end(tokens: list[str], eog: set[int]) -> set[int]:
    """The id of ``<|end|>`` when it must not end generation: llama.cpp's o200k_harmony (gpt-oss) rule,
    an EOG set holding ``<|return|>`` and ``<|call|>`` (or ``<|calls|>`` and ``<|flush|>``) drops
    ``<|end|>``, which only closes a message (the analysis channel) before the final answer."""
    texts = {tokens[i]: i for i in eog if 0 <= i < len(tokens)}
    call = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and call and ("<|return|>" in texts or "<|flush|>" in texts):
        return {texts["<|end|>"]}
    return set()


# GGUF key suffix (after "tokenizer.") -> the name transformers' converter expects.
_GGUF_TOKENIZER_KEYS = {
    "ggml.model": "tokenizer_type",
    "ggml.pre": "pre_tokenizer_type",
    "ggml.tokens": "tokens",
    "ggml.scores": "scores",
    "ggml.token_type": "token_type",
    "ggml.merges": "merges",
    "ggml.precompiled_charsmap": "precompiled_charsmap",
    "ggml.add_space_prefix": "add_prefix_space",
}

# The Qwen2 pre-tokenizer split (tokenizer.ggml.pre = "qwen2").
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


#: GGUF architecture -> the model type transformers' older converter table (``integrations.ggml``) uses
_GGML_CONVERTER_NAMES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}


def _convert_gguf_tokenizer(architecture: str, spec: dict[str, Any]):
    """transformers' GGUF tokenizer conversion, in ``integrations.gguf`` (5.20 and later) or in
    ``integrations.ggml`` keyed by HF model type (earlier releases)."""
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer
    except ImportError:
        from transformers.integrations.ggml import convert_gguf_tokenizer

        from transformers.integrations.ggml import GGUF_TO_FAST_CONVERTERS

        architecture = _GGML_CONVERTER_NAMES.get(architecture, architecture)
        if architecture not in GGUF_TO_FAST_CONVERTERS:  # e.g. deepseek2, gpt-oss before transformers knew them
            architecture = "gpt2"  # the generic byte-level BPE converter ("gpt2" is all Strata reads)
    return convert_gguf_tokenizer(architecture, spec)


def _add_whole_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Make the CONTROL and USER_DEFINED tokens of the GGUF added tokens of ``backend``, so a text holding
    one (``<|im_start|>``, ``<think>``) encodes it whole, as llama.cpp does; transformers' conversion does
    this for some token types only, and which depends on its version."""
    control = [tokenizers.AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
               if k == gguf.TokenType.CONTROL]
    user = [tokenizers.AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types)
            if k == gguf.TokenType.USER_DEFINED]
    backend.add_special_tokens(control)
    backend.add_tokens(user)


class Tokenizer:
    """Encode text to token ids and decode them back, with the special tokens of the model."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        vocab_size: int,
        bos_token_id: int | None,
        eos_token_ids: set[int],
        add_bos: bool = False,
        max_token_chars: int | None = None,
    ) -> None:
        self.backend = backend
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos
        #: characters of the longest token's text (a byte-level token's text has a character per
        #: byte); a text of n characters has at least n / max_token_chars tokens
        self.max_token_chars = max_token_chars

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any] | str | os.PathLike[str]) -> Tokenizer:
        """Build from a GGUF's metadata dict (or the path of a GGUF file)."""
        if not isinstance(metadata, Mapping):
            metadata = GGUFFile.open(metadata).metadata
        if "tokenizer.ggml.tokens" not in metadata:
            raise ModelFileError("the GGUF has no tokenizer (no tokenizer.ggml.tokens key)")
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise UnsupportedError(f"tokenizer.ggml.model {model!r} is not supported; Strata reads 'gpt2' (byte-level BPE)")

        if "tokenizer.ggml.merges" not in metadata:
            raise ModelFileError("the GGUF's BPE tokenizer has no merges (tokenizer.ggml.merges)")
        spec = {name: metadata[f"tokenizer.{key}"] for key, name in _GGUF_TOKENIZER_KEYS.items() if f"tokenizer.{key}" in metadata}
        spec["tokens"] = [str(t) for t in spec["tokens"]]
        spec["merges"] = [str(m) for m in spec.get("merges", [])]
        spec["token_type"] = [int(t) for t in spec.get("token_type", [])]
        try:
            backend, _ = _convert_gguf_tokenizer(str(metadata.get("general.architecture", "")), spec)
        except Exception as exc:  # the tokenizers library raises plain Exception on bad vocabularies or merges
            raise ModelFileError(f"the GGUF's tokenizer metadata is malformed: {exc}") from exc
        backend.post_processor = None  # BOS is added here, from tokenizer.ggml.add_bos_token
        tokens = spec["tokens"]
        _add_whole_tokens(backend, tokens, spec["token_type"])

        bos = metadata.get("tokenizer.ggml.bos_token_id")
        eog = {i for i, t in enumerate(tokens) if t in _EOG_TEXTS}
        eog |= {int(metadata[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in metadata}
        eog -= _harmony_end(tokens, eog)
        return cls(
            backend,
            vocab_size=len(tokens),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eog,
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bos is not None,
            max_token_chars=max(map(len, tokens), default=1),
        )

    def min_tokens(self, text: str) -> int:
        """A lower bound on ``len(encode(text))``, computed without encoding (0 when unknown)."""
        return -(-len(text) // self.max_token_chars) if self.max_token_chars else 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token texts in it (``<|im_start|>``) become their ids.

        ``add_special_tokens`` prepends BOS when the GGUF asks for it (``add_bos_token``).
        """
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; control tokens are left out when ``skip_special_tokens``."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A fresh incremental decoder for one generated sequence."""
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)


class StreamDecoder:
    """Turn tokens into text as they arrive, giving out only complete characters.

    A byte-level token can end inside a UTF-8 character; its text is held back until the
    character is complete. The text of every ``push`` plus ``flush`` equals ``decode`` of all ids.
    Uses the prefix/read window of text-generation-inference, so decoders that depend on the
    previous token (leading spaces) stay correct.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # ids before this were given out

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became complete ("" when none did)."""
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Return whatever is held back (an incomplete character decodes to U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix : self._read], self._skip)
        text = decode(self._ids[self._prefix :], self._skip)
        if len(text) > len(prefix_text) and (final or not text.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(prefix_text) :]
        return ""


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level map reversed: the byte each stand-in character of a vocabulary string means."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = iter(range(256, 512))
    return {(chr(b) if b in printable else chr(next(others))): b for b in range(256)}


def token_bytes(backend: tokenizers.Tokenizer, ids: Iterable[int]) -> list[bytes]:
    """The bytes each of ``ids`` stands for in the byte-level BPE ``backend``, alone (a token may hold
    part of a character): an added token's text (``<|im_start|>``) as UTF-8, any other its vocabulary
    string read through GPT-2's byte map."""
    added = backend.get_added_tokens_decoder()
    table = _byte_of_char()
    out = []
    for token_id in ids:
        text = backend.id_to_token(token_id) or ""
        byte_level = token_id not in added and all(ch in table for ch in text)
        out.append(bytes(table[ch] for ch in text) if byte_level else text.encode())
    return out


def train_byte_level_bpe(
    texts: Iterable[str], vocab_size: int, special_tokens: list[str], *, min_frequency: int = 2
) -> tokenizers.Tokenizer:
    """Train a Qwen2-style byte-level BPE (``tokenizer.ggml.pre = "qwen2"``) on ``texts``.

    Special tokens get the first ids, the 256 byte symbols come next, then the learned merges.
    """
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok
