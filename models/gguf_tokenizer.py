"""The tokenizer a GGUF file's metadata describes, built with the ``tokenizers``
library (``gguf_tokenizer``): byte-level BPE (``gpt2``) or SentencePiece BPE (``llama``)
vocabularies and merges, with the file's special tokens and chat template. No JAX."""

from __future__ import annotations

import os
from typing import Any

from .gguf_fields import GGUFError
from .gguf_fields import field as _field
from .gguf_fields import token_id as _token_id
from .tokenizer import TextTokenizer

# token_type values of tokenizer.ggml.token_type
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split patterns, by tokenizer.ggml.pre (the models' published regexes).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = ("default", "gpt2", "gpt-2", "smollm", "llama-bpe", "llama3", "qwen2")


def gguf_tokenizer(reader: Any, path: str | os.PathLike = "<gguf>") -> Any | None:
    """The tokenizer a GGUF file's metadata describes (a ``TextTokenizer``: a
    ``tokenizers.Tokenizer`` with the file's chat template and special tokens), or None if
    it has no ``tokenizer.ggml.model``. Raises ``GGUFError`` for an unsupported tokenizer model or
    pre-tokenizer."""
    model = _field(reader, "tokenizer.ggml.model", path, None, "str")
    if model is None:
        return None
    tokens = _field(reader, "tokenizer.ggml.tokens", path, kind="strs")
    types = _field(reader, "tokenizer.ggml.token_type", path, [_NORMAL] * len(tokens), "ints")
    if len(types) != len(tokens):
        raise GGUFError(
            f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    if model == "gpt2":
        tok = _byte_level_bpe(reader, path, tokens)
        default_bos = False
    elif model == "llama":
        tok = _sentencepiece_bpe(reader, path, tokens, types)
        default_bos = True
    else:
        raise GGUFError(
            f"{path}: tokenizer.ggml.model {model!r} is not supported (supported: gpt2, llama)"
        )
    from tokenizers import AddedToken, processors

    special = [
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k in (_CONTROL, _UNKNOWN)
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, types, strict=True)
        if k == _USER_DEFINED
    ]
    tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    bos = _token_id(reader, "tokenizer.ggml.bos_token_id", path, len(tokens))
    eos = _token_id(reader, "tokenizer.ggml.eos_token_id", path, len(tokens))
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token", path, default_bos, "bool")
    add_eos = _field(reader, "tokenizer.ggml.add_eos_token", path, False, "bool")
    single, specials = "$A:0", []
    if add_bos and bos is not None:
        single = f"{tokens[bos]}:0 {single}"
        specials.append((tokens[bos], int(bos)))
    if add_eos and eos is not None:
        single = f"{single} {tokens[eos]}:0"
        specials.append((tokens[eos], int(eos)))
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    names = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown")):
        i = _token_id(reader, f"tokenizer.ggml.{key}_token_id", path, len(tokens))
        if i is not None:
            names[name] = tokens[i]
    template = _field(reader, "tokenizer.chat_template", path, None, "str")
    return TextTokenizer(tok, chat_template=template, special_tokens=names)


def _byte_level_bpe(reader: Any, path: Any, tokens: list[str]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    merges = [
        tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", path, kind="strs")
    ]
    pre = _field(reader, "tokenizer.ggml.pre", path, "default", "str")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(
            f"{path}: tokenizer.ggml.pre {pre!r} is not supported (supported: "
            f"{', '.join(PRE_TOKENIZERS)})"
        )
    vocab = {t: i for i, t in enumerate(tokens)}
    llama3 = pre in ("llama-bpe", "llama3")
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=llama3))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if llama3 or pre == "qwen2":
        split = pre_tokenizers.Split(
            Regex(_LLAMA3_SPLIT if llama3 else _QWEN2_SPLIT), behavior="isolated"
        )
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pre == "smollm":  # digits one by one, then GPT-2's split
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(reader: Any, path: Any, tokens: list[str], types: list[int]) -> Any:
    """SentencePiece BPE: merges recovered from the pieces' scores (a pair of pieces merges
    into their concatenation, higher scores first), "▁" for spaces, byte fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = _field(reader, "tokenizer.ggml.scores", path, kind="floats")
    if len(scores) != len(tokens):
        raise GGUFError(
            f"{path}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens"
        )
    vocab = {t: i for i, t in enumerate(tokens)}
    mergeable = {t: i for i, t in enumerate(tokens) if types[i] in (_NORMAL, _USER_DEFINED)}
    ranked = []
    for piece, i in mergeable.items():
        for k in range(1, len(piece)):
            a, b = piece[:k], piece[k:]
            if a in mergeable and b in mergeable:
                ranked.append((-scores[i], i, vocab[a], a, b))
    ranked.sort()
    unk = _token_id(reader, "tokenizer.ggml.unknown_token_id", path, len(tokens))
    tok = Tokenizer(
        models.BPE(
            vocab,
            [(a, b) for *_, a, b in ranked],
            unk_token=None if unk is None else tokens[unk],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = _field(reader, "tokenizer.ggml.add_space_prefix", path, True, "bool")
    steps = [normalizers.Replace(" ", "\u2581")]
    if prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    return tok
