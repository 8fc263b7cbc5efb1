"""The tokenizer a GGUF file describes, built on the `tokenizers` library.

GGUF keeps no ``tokenizer.json``; it stores llama.cpp's description (``tokenizer.ggml.*``): the
vocabulary, the BPE merges, a type per token (1 normal, 3 control, 4 user-defined ...), the
special token ids, and ``tokenizer.ggml.pre``, the name of the pre-tokenizer (how text is split
into words before the merges apply). We rebuild the same tokenizer from those: a byte-level BPE
model, the pre-tokenizer that name stands for, a byte-level decoder, and the control tokens as
special tokens so they are matched whole.
"""

from __future__ import annotations

from typing import Iterable

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
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


class Tokenizer:
    """Byte-level BPE tokenizer with special tokens, BOS/EOS handling and decoding.

    Build it with `Tokenizer.from_gguf`. Ids are ints in ``[0, vocab_size)``.
    """

    def __init__(
        self,
        tokens: list[str],
        merges: list[str],
        token_types: list[int] | None,
        pre: str | None,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos: bool,
        chat_template: str | None,
        extra_eog_ids: Iterable[int] = (),
    ):
        vocab = {tok: i for i, tok in enumerate(tokens)}
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False)
        types = list(token_types) if token_types is not None else [1] * len(tokens)

        self._tok = self._build(bpe, pre, tokens, types)
        self._tok_literal = self._build(models.BPE(vocab=vocab, merges=pairs), pre, tokens, types)
        self._tok_literal.encode_special_tokens = True  # special-token text stays plain text

        self.tokens = tokens
        self.vocab_size = len(tokens)
        self.special_ids = {i for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL}
        self.special_texts = frozenset(tokens[i] for i in self.special_ids)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos and bos_token_id is not None
        self.chat_template = chat_template
        eog = {i for i in self.special_ids if tokens[i] in _EOG_TEXTS}
        eog.update(i for i in (eos_token_id, *extra_eog_ids) if i is not None)
        self.eog_token_ids = frozenset(eog)

    @staticmethod
    def _build(bpe, pre, tokens, types) -> HFTokenizer:
        tok = HFTokenizer(bpe)
        tok.pre_tokenizer = _pre_tokenizer(pre)
        tok.decoder = decoders.ByteLevel()
        control = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_CONTROL]
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_USER_DEFINED]
        tok.add_special_tokens(control)
        tok.add_tokens(user)
        return tok

    @classmethod
    def from_gguf(cls, f) -> "Tokenizer":
        """Build the tokenizer from a `GGUFFile`'s ``tokenizer.ggml.*`` metadata.

        Byte-level BPE (``tokenizer.ggml.model == "gpt2"``) only; other vocabularies raise
        `ModelLoadError`. Byte-level vocabularies get no BOS prepended (as in `transformers`,
        whose reference ids the tests hold us to), whatever ``add_bos_token`` says.
        """
        model = f.get("tokenizer.ggml.model")
        if model is None:
            raise ModelLoadError(f"{f.path}: the GGUF file has no tokenizer (tokenizer.ggml.*)")
        if model != "gpt2":
            raise ModelLoadError(
                f"{f.path}: tokenizer model {model!r} is not supported yet; supported: 'gpt2' "
                "(byte-level BPE)"
            )
        eot = [f.get(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
        return cls(
            tokens=list(f.require("tokenizer.ggml.tokens")),
            merges=list(f.get("tokenizer.ggml.merges") or []),
            token_types=f.get("tokenizer.ggml.token_type"),
            pre=f.get("tokenizer.ggml.pre"),
            bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=f.get("tokenizer.ggml.eos_token_id"),
            add_bos=False,
            chat_template=f.get("tokenizer.chat_template"),
            extra_eog_ids=[i for i in eot if i is not None],
        )

    # -- encode / decode --------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of `text`.

        `parse_special`: special-token strings in the text (``<|im_end|>``) become their control
        token; when False they stay literal text. `add_bos` defaults to the model's convention.
        """
        if not isinstance(text, str):
            raise InvalidRequest(f"prompt must be a string, got {type(text).__name__}", "prompt")
        tok = self._tok if parse_special else self._tok_literal
        ids = tok.encode(text, add_special_tokens=False).ids
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

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    # -- chat -------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render `messages` with the model's chat template (see `chat_template.render`)."""
        from nextoken.tokenizer.chat_template import render

        if not self.chat_template:
            raise InvalidRequest(
                "this model has no chat template; use a raw prompt (--raw) instead", "messages"
            )
        bos = self.tokens[self.bos_token_id] if self.bos_token_id is not None else ""
        eos = self.tokens[self.eos_token_id] if self.eos_token_id is not None else ""
        return render(self.chat_template, messages, add_generation_prompt, bos, eos)
