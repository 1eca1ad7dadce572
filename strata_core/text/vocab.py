"""Check a GGUF's tokenizer keys (``tokenizer.ggml.*``) at load, so a broken vocabulary is a clear
``ModelFileError`` naming the file and the key, not a failure at the first request."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from strata_core.text.chat import ChatTemplate
from strata_core.errors import ModelFileError

__all__ = ["check_tokenizer_metadata"]

_TOKEN_ID_KEYS = ("bos", "eos", "eot", "eom", "padding", "unknown", "seperator")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_merge(value: Any) -> bool:
    """A BPE merge: two non-empty parts joined by one space."""
    parts = value.split(" ") if isinstance(value, str) else []
    return len(parts) == 2 and all(parts)


def check_tokenizer_metadata(metadata: Mapping[str, Any], path: str, vocab_size: int) -> None:
    """Raise ModelFileError unless the tokenizer keys are well typed and consistent.

    A file without ``tokenizer.ggml.tokens`` has no tokenizer (token ids only) and passes.
    ``vocab_size`` is the rows of ``token_embd``: no token may lie beyond them.
    """
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        return

    def bad(key: str, expected: str) -> ModelFileError:
        value = metadata.get(key)
        shown = f"a list of {len(value)}" if isinstance(value, list) else repr(value)[:60]
        return ModelFileError(f"{path}: tokenizer key {key!r} is {shown}, expected {expected}")

    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise bad("tokenizer.ggml.tokens", "a non-empty list of strings")
    if len(tokens) > vocab_size:
        raise bad("tokenizer.ggml.tokens", f"at most {vocab_size} tokens (the rows of token_embd.weight)")
    model = metadata.get("tokenizer.ggml.model")
    if not isinstance(model, str):
        raise bad("tokenizer.ggml.model", "a string")
    for key in ("tokenizer.ggml.pre", "tokenizer.chat_template"):
        if key in metadata and not isinstance(metadata[key], str):
            raise bad(key, "a string")
    if "tokenizer.ggml.add_bos_token" in metadata and not isinstance(metadata["tokenizer.ggml.add_bos_token"], bool):
        raise bad("tokenizer.ggml.add_bos_token", "a boolean")
    merges = metadata.get("tokenizer.ggml.merges")
    if model == "gpt2" and (not isinstance(merges, list) or not merges or not all(_is_merge(m) for m in merges)):
        raise bad("tokenizer.ggml.merges", 'a non-empty list of "left right" strings (a BPE vocabulary needs its merges)')
    if model == "gpt2":
        vocab = set(tokens)
        for merge in merges:  # the BPE backend needs both parts and their join in the vocabulary
            left, right = merge.split(" ")
            if left not in vocab or right not in vocab or left + right not in vocab:
                raise ModelFileError(f"{path}: tokenizer merge {merge!r} names a token that is not in "
                                     "tokenizer.ggml.tokens")
    types = metadata.get("tokenizer.ggml.token_type")
    if types is not None and (not isinstance(types, list) or len(types) != len(tokens)
                              or not all(_is_int(t) for t in types)):
        raise bad("tokenizer.ggml.token_type", f"a list of {len(tokens)} integers, one per token")
    if "tokenizer.chat_template" in metadata:
        try:
            ChatTemplate(metadata["tokenizer.chat_template"])
        except ModelFileError as error:
            raise ModelFileError(f"{path}: tokenizer.chat_template: {error}") from None
    for name in _TOKEN_ID_KEYS:
        key = f"tokenizer.ggml.{name}_token_id"
        if key in metadata and not (_is_int(metadata[key]) and 0 <= metadata[key] < len(tokens)):
            raise bad(key, f"a token id in [0, {len(tokens)})")
