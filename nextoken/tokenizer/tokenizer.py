"""Tokenizers: the one a GGUF file describes, or a Hugging Face ``tokenizer.json``, built on
the `tokenizers` library.

GGUF keeps no ``tokenizer.json``; it stores llama.cpp's description (``tokenizer.ggml.*``): the
vocabulary, a type per token (1 normal, 3 control, 4 user-defined, 6 byte), the special token
ids, and, by ``tokenizer.ggml.model``:
- ``gpt2``: byte-level BPE with its merges and ``tokenizer.ggml.pre``, the name of the
  pre-tokenizer (how text is split into words before the merges apply). We rebuild a byte-level
  BPE model, the pre-tokenizer that name stands for and a byte-level decoder.
- ``llama``: a SentencePiece-style BPE vocabulary with scores and no merges (Gemma, Llama 2).
  Spaces are written ``▁`` (U+2581); unknown characters fall back to byte tokens ``<0x41>``.
  SentencePiece's BPE merges the adjacent pair whose joined piece ranks best, so the merges are
  rebuilt from the vocabulary: every split of a piece into two pieces of the vocabulary, ranked
  by the joined piece. The rank is the score, except for Gemma, whose scores do not follow its
  merge order while the order of the pieces in the file does (as `transformers`' GGUF converter
  found; the reference ids in the tests come from it). Finding them takes a second for Gemma
  3's 262k pieces, so the loader keeps them in the user's cache (`cached_sentencepiece_merges`).
Control tokens become special tokens and user-defined ones added tokens, so both are matched
whole in the text.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from pathlib import Path
from typing import Iterable

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from nextoken.errors import InvalidRequest, ModelLoadError
# Split patterns (how text is cut into words before BPE), by `tokenizer.ggml.pre`. Sources: the
# `pre_tokenizer` of each model family's tokenizer.json, as llama.cpp's llama-vocab.cpp lists them.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
}

# Texts of tokens that end a turn in the chat formats we know. llama.cpp treats these as
# end-of-generation too (llama-vocab.cpp, `special_eog_ids`), whatever the file's EOS id says.
_EOG_TEXTS = {
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>",
    "<|end|>", "</s>", "<|return|>", "<|eom_id|>",
}

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5


def _pre_tokenizer(pre: str | None):
    """The pre-tokenizer for llama.cpp's pre-tokenizer name `pre`."""
    if pre in _SPLIT_BY_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre == "smollm":  # GPT-2's split, with every digit its own word
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in (None, "default", "gpt2", "gpt-2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    raise ModelLoadError(
        f"tokenizer pre-tokenizer {pre!r} is not supported; supported: "
        f"{sorted([*_SPLIT_BY_PRE, 'smollm', 'gpt2', 'default'])}"
    )


def _add_typed_tokens(tok: HFTokenizer, tokens: list[str], types: list[int], skip=frozenset()) -> None:
    """Control tokens as special tokens, user-defined ones as added tokens (both matched whole)."""
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_USER_DEFINED and t not in skip])


def byte_level_bpe(tokens: list[str], merges: list[str], types: list[int], pre: str | None) -> HFTokenizer:
    """GPT-2-style byte-level BPE: `merges` are ``"left right"`` strings, best first."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    _add_typed_tokens(tok, tokens, types)
    return tok


SPACE = "\u2581"  # SentencePiece's visible space


def sentencepiece_merges(tokens: list[str], ranks: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: each split of a piece into two pieces
    of the vocabulary, ordered by the joined piece's rank (lower first), then by a longer left
    piece. tokens[i] has rank ranks[i]."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for piece, i in vocab.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((ranks[i], -len(left), -len(right), vocab[left], vocab[right], left, right))
    found.sort()
    return [(f[5], f[6]) for f in found]


def cached_sentencepiece_merges(tokens: list[str], ranks: list[float], cache: Path) -> list[tuple[str, str]]:
    """`sentencepiece_merges`, kept in the file `cache` (`loader.prepared.merges_path`, named by
    the model file's hash) as their pieces' ids (``[n, 2]`` int32, NumPy's format): read when it
    holds ids of this vocabulary, else found and written (through a temporary file and
    ``os.replace``; quietly not where it cannot be written). Reading Gemma 3's 515k merges takes
    a tenth of a second where finding them takes a second."""
    try:
        ids = np.load(cache, allow_pickle=False)
        if ids.dtype == np.int32 and ids.ndim == 2 and ids.shape[1] == 2 and \
                (ids.size == 0 or (ids.min() >= 0 and ids.max() < len(tokens))):
            return list(zip(map(tokens.__getitem__, ids[:, 0].tolist()), map(tokens.__getitem__, ids[:, 1].tolist())))
    except (OSError, ValueError, EOFError):
        pass
    merges = sentencepiece_merges(tokens, ranks)
    vocab = {t: i for i, t in enumerate(tokens)}
    ids = np.array([(vocab[a], vocab[b]) for a, b in merges], dtype=np.int32).reshape(-1, 2)
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as fh:
            np.save(fh, ids, allow_pickle=False)
        os.replace(tmp, cache)
    except OSError:
        tmp.unlink(missing_ok=True)
    return merges


def sentencepiece_bpe(tokens: list[str], ranks: list[float], types: list[int], add_space_prefix: bool,
                      merges_cache: Path | None = None) -> HFTokenizer:
    """SentencePiece-style BPE with byte fallback. Spaces become ``▁`` (and one is prepended to
    the text when `add_space_prefix`); a token of several spaces, stored as real spaces in GGUF,
    is spelled with ``▁`` so it takes part in merges. `merges_cache`: where the merges are kept
    (`cached_sentencepiece_merges`)."""
    tokens = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = next((t for t in ("<unk>",) if t in vocab), None)
    merges = sentencepiece_merges(tokens, ranks) if merges_cache is None else \
        cached_sentencepiece_merges(tokens, ranks, merges_cache)
    bpe = models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    tok = HFTokenizer(bpe)
    steps = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    steps = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *steps])
    _add_typed_tokens(tok, tokens, types, skip={t for t in tokens if t and not t.strip(SPACE)})
    return tok


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (Radford et al. 2019, `bytes_to_unicode`), inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


class Tokenizer:
    """Text <-> token ids with special tokens, BOS/EOS handling and decoding.

    Build it with `Tokenizer.from_gguf` or `Tokenizer.from_hf_dir`. Ids are ints in
    ``[0, vocab_size)``. `hf` parses special-token text as special tokens; for text that must
    stay literal (`encode` with ``parse_special=False``) the same tokenizer runs with its
    ``encode_special_tokens`` switched on, under a lock (a second copy for that, built from the
    first's JSON, would cost every start its construction again).
    """

    def __init__(
        self,
        hf: HFTokenizer,
        tokens: list[str],
        special_ids: Iterable[int],
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos: bool,
        chat_template: str | None,
        extra_eog_ids: Iterable[int] = (),
        unused_ids: Iterable[int] = (),
    ):
        self._tok = hf
        self.hf_tokenizer = hf  # the `tokenizers.Tokenizer` (read-only use: its JSON, normalizer, pre-tokenizer)
        self._encode_lock = threading.Lock()  # encode_special_tokens is the tokenizer's state
        self.tokens = tokens
        self.vocab_size = len(tokens)
        self.special_ids = frozenset(special_ids)
        self.special_texts = frozenset(tokens[i] for i in self.special_ids)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos and bos_token_id is not None
        self.chat_template = chat_template
        eog = {i for i in self.special_ids if tokens[i] in _EOG_TEXTS}
        eog.update(i for i in (eos_token_id, *extra_eog_ids) if i is not None)
        self.eog_token_ids = frozenset(eog)
        # ids the vocabulary reserves but no text maps to (Qwen's "[PAD151665]"; gaps in a
        # tokenizer.json): never sampled under structured output
        self.unused_ids = frozenset(unused_ids) | frozenset(i for i, t in enumerate(tokens) if not t)

    def __getstate__(self) -> dict:  # pickled without its lock (the engine process sends its tokenizer)
        return {k: v for k, v in self.__dict__.items() if k != "_encode_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._encode_lock = threading.Lock()

    @classmethod
    def from_gguf(cls, f, merges_cache: Path | None = None) -> "Tokenizer":
        """Build the tokenizer from a `GGUFFile`'s ``tokenizer.ggml.*`` metadata.

        ``tokenizer.ggml.model`` ``gpt2`` (byte-level BPE) or ``llama`` (SentencePiece-style
        BPE); others raise `ModelLoadError`. Byte-level vocabularies get no BOS prepended (as in
        `transformers`, whose reference ids the tests hold us to), whatever ``add_bos_token``
        says; SentencePiece ones follow ``tokenizer.ggml.add_bos_token`` (default on, as
        llama.cpp), since those models expect ``<bos>`` first. `merges_cache`: the file that keeps
        a SentencePiece vocabulary's merges (`cached_sentencepiece_merges`; the loader's is
        `loader.prepared.merges_path`), or None (found each time).
        """
        model = f.get("tokenizer.ggml.model")
        if model is None:
            raise ModelLoadError(f"{f.path}: the GGUF file has no tokenizer (tokenizer.ggml.*)")
        tokens = list(f.require("tokenizer.ggml.tokens"))
        types = list(f.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        if model == "gpt2":
            hf = byte_level_bpe(tokens, list(f.get("tokenizer.ggml.merges") or []), types, f.get("tokenizer.ggml.pre"))
            add_bos = False
        elif model == "llama":
            scores = f.get("tokenizer.ggml.scores")
            by_position = str(f.get("general.architecture", "")).startswith("gemma") or scores is None
            ranks = list(range(len(tokens))) if by_position else [-s for s in scores]
            hf = sentencepiece_bpe(tokens, ranks, types, bool(f.get("tokenizer.ggml.add_space_prefix", True)),
                                   merges_cache)
            add_bos = bool(f.get("tokenizer.ggml.add_bos_token", True))
        else:
            raise ModelLoadError(
                f"{f.path}: tokenizer model {model!r} is not supported; supported: 'gpt2' (byte-level "
                "BPE), 'llama' (SentencePiece-style BPE)"
            )
        eot = [f.get(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
        return cls(
            hf, tokens,
            special_ids=[i for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL],
            bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=f.get("tokenizer.ggml.eos_token_id"),
            add_bos=add_bos,
            chat_template=f.get("tokenizer.chat_template"),
            extra_eog_ids=[i for i in eot if i is not None],
            unused_ids=[i for i, t in enumerate(types) if t == TOKEN_TYPE_UNUSED],
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike, generation_eos: Iterable[int] = ()) -> "Tokenizer":
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` (chat template, BOS/EOS, whether
        to add BOS) from a Hugging Face model folder. `generation_eos`: extra end-of-generation
        ids (``generation_config.json``). Raises `ModelLoadError` when tokenizer.json is missing."""
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise ModelLoadError(f"{path}: no tokenizer.json (only the fast-tokenizer format is read; "
                                 "save the tokenizer with `save_pretrained` from a fast tokenizer)")
        hf = HFTokenizer.from_file(tj)
        hf.no_padding()  # one prompt at a time, never cut: the engine checks lengths itself
        hf.no_truncation()
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        vocab = hf.get_vocab(with_added_tokens=True)
        tokens = [""] * (max(vocab.values()) + 1)
        for text, i in vocab.items():
            tokens[i] = text
        special_ids = [i for i, t in hf.get_added_tokens_decoder().items() if t.special]

        def token_id(key):
            value = cfg.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return vocab.get(value) if isinstance(value, str) else None

        template = cfg.get("chat_template")
        jinja = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as fh:
                template = fh.read()
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        bos = token_id("bos_token")
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # unsaid: whatever tokenizer.json's post-processor does (Llama 3 adds BOS there)
            with_special = hf.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and bool(with_special) and with_special[0] == bos
        return cls(hf, tokens, special_ids, bos, token_id("eos_token"),
                   add_bos=bool(add_bos), chat_template=template,
                   extra_eog_ids=generation_eos)

    # -- encode / decode --------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of `text`.

        `parse_special`: special-token strings in the text (``<|im_end|>``) become their control
        token; when False they stay literal text. `add_bos` defaults to the model's convention.
        """
        if not isinstance(text, str):
            raise InvalidRequest(f"prompt must be a string, got {type(text).__name__}", "prompt")
        with self._encode_lock:
            self._tok.encode_special_tokens = not parse_special  # True: special-token text stays text
            try:
                ids = self._tok.encode(text, add_special_tokens=False).ids
            finally:
                self._tok.encode_special_tokens = False
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of token `ids`; invalid UTF-8 byte sequences become U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """What one token reads as on its own (for display)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    @functools.cached_property
    def byte_level(self) -> bool:
        """Whether pieces are in GPT-2's byte-level alphabet (its pre-tokenizer or decoder says
        ByteLevel). Read on first use: serializing a large vocabulary takes a tenth of a second."""
        tj = json.loads(self._tok.to_str())
        return any('"ByteLevel"' in json.dumps(tj.get(k)) for k in ("pre_tokenizer", "decoder"))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for: its byte-level alphabet decoded, a ``<0xNN>``
        byte-fallback piece's byte, SentencePiece's ``▁`` as a space; a special token's text."""
        piece = self.tokens[token_id]
        if token_id in self.special_ids:
            return piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        if self.byte_level:
            dec = _byte_decoder()
            if all(c in dec for c in piece):
                return bytes(dec[c] for c in piece)
        return piece.replace(SPACE, " ").encode()

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    # -- chat -------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, extra: dict | None = None,
                            template: str | None = None) -> str:
        """Render `messages` (and `tools`, and the template variables `extra`) with the model's
        chat template, or `template` (a Jinja source) when given (see `chat_template.render`)."""
        from nextoken.tokenizer.chat_template import render

        if template is not None:
            return render(template, messages, add_generation_prompt, *self._bos_eos(), tools, extra)
        if not self.chat_template:
            raise InvalidRequest(
                "this model has no chat template: send a plain prompt instead (/v1/completions, /api/generate; "
                "`nextoken run --raw`), or give the engine one with --chat-template FILE", "messages"
            )
        return render(self.chat_template, messages, add_generation_prompt, *self._bos_eos(), tools, extra)

    def _bos_eos(self) -> tuple[str, str]:
        """The templates' ``bos_token`` and ``eos_token`` (empty where the model has none)."""
        bos = self.tokens[self.bos_token_id] if self.bos_token_id is not None else ""
        eos = self.tokens[self.eos_token_id] if self.eos_token_id is not None else ""
        return bos, eos
