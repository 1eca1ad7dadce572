"""Write a byte-level BPE tokenizer into a GGUF the way llama.cpp's converter does.

The keys and values match ``convert_hf_to_gguf.py`` (``TextModel._set_vocab_gpt2`` with
``gguf.SpecialVocab``) for a Qwen2/Qwen3-style tokenizer:

- ``tokenizer.ggml.model = "gpt2"``, ``tokenizer.ggml.pre = "qwen2"``
- ``tokenizer.ggml.tokens`` (byte-level spelling, ``[PAD{i}]`` for holes up to ``vocab_size``)
- ``tokenizer.ggml.token_type`` (NORMAL, CONTROL for special added tokens and ``<|...|>`` names,
  USER_DEFINED for other added tokens, UNUSED for holes)
- ``tokenizer.ggml.merges`` (``"a b"`` strings; a space inside a part is written as U+0120+256)
- ``tokenizer.ggml.{bos,eos,padding}_token_id``, ``tokenizer.ggml.add_{bos,eos}_token``
- ``tokenizer.chat_template`` when a template is given
"""

from __future__ import annotations

import json

import gguf
import tokenizers

from strata_core.errors import StrataError

__all__ = ["add_tokenizer_metadata"]


def _looks_special(token: str) -> bool:
    """llama.cpp's ``does_token_look_special``: names it treats as control tokens."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def _merges(tokenizer: tokenizers.Tokenizer) -> list[str]:
    """The BPE merges as ``"left right"`` strings, spaces inside parts escaped like llama.cpp."""
    model = json.loads(tokenizer.to_str())["model"]
    if model.get("type") != "BPE":
        raise StrataError(f"add_tokenizer_metadata needs a BPE tokenizer, got model type {model.get('type')!r}")
    merges = model.get("merges") or []
    if merges and isinstance(merges[0], str):
        return list(merges)
    return [" ".join(part.replace(" ", chr(ord(" ") + 256)) for part in pair) for pair in merges]


def _token_id(tokenizer: tokenizers.Tokenizer, token: str, role: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise StrataError(f"{role} token {token!r} is not in the tokenizer's vocabulary")
    return token_id


def add_tokenizer_metadata(
    writer: gguf.GGUFWriter,
    tokenizer: tokenizers.Tokenizer,
    chat_template: str | None = None,
    *,
    bos: str | None,
    eos: str,
    pad: str | None = None,
    add_bos: bool = False,
    vocab_size: int | None = None,
    pre: str = "qwen2",
) -> None:
    """Add the tokenizer keys llama.cpp writes for a byte-level BPE (``tokenizer.ggml.model=gpt2``).

    ``bos``/``eos``/``pad`` are token texts (``bos=None`` writes no BOS id, as for Qwen chat
    models; ``pad`` defaults to ``eos``). ``vocab_size`` is the model's embedding rows when larger
    than the tokenizer's vocabulary; the extra ids become ``[PAD{i}]`` UNUSED tokens. ``pre`` names
    the pre-tokenizer regex llama.cpp should use; it must match how ``tokenizer`` splits text.
    """
    if add_bos and bos is None:
        raise StrataError("add_bos=True needs a bos token")
    id_to_token = {i: t for t, i in tokenizer.get_vocab(with_added_tokens=True).items()}
    added = tokenizer.get_added_tokens_decoder()
    n_vocab = vocab_size if vocab_size is not None else max(id_to_token) + 1
    if max(id_to_token) >= n_vocab:
        raise StrataError(f"vocab_size {n_vocab} is smaller than the tokenizer's largest id {max(id_to_token)}")

    tokens: list[str] = []
    types: list[int] = []
    for i in range(n_vocab):
        token = id_to_token.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            if not added[i].normalized:
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False).ids, skip_special_tokens=False)
            special = added[i].special or _looks_special(token)
            tokens.append(token)
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(token)
            types.append(gguf.TokenType.NORMAL)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(_merges(tokenizer))
    if bos is not None:
        writer.add_bos_token_id(_token_id(tokenizer, bos, "bos"))
    writer.add_eos_token_id(_token_id(tokenizer, eos, "eos"))
    writer.add_pad_token_id(_token_id(tokenizer, pad if pad is not None else eos, "pad"))
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
