"""The model's tokenizer with the methods scripts call on a `transformers` tokenizer: what
vLLM's ``LLM.get_tokenizer()`` returns is one, and scripts written for it render their prompts
with ``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``,
count tokens with ``tokenizer.encode`` or ``len(tokenizer(text).input_ids)``, and read
``eos_token_id``. `HFStyleTokenizer` answers those over nextoken's `Tokenizer` (no
`transformers` needed): the same ids and text as the engine's, the same template rendering.
"""

from __future__ import annotations

import functools
from typing import Iterable

from nextoken.errors import InvalidRequest
from nextoken.tokenizer.chat_template import chat_prompt

# apply_chat_template's keywords that shape a tensor or a mask: no meaning for a list of ids here
_REFUSED = ("padding", "truncation", "max_length", "return_tensors", "return_assistant_tokens_mask", "documents")


class Encoding(dict):
    """A tokenizer call's result, read as a dict or by attribute (``enc.input_ids``)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class HFStyleTokenizer:
    """`tokenizer` (nextoken's `Tokenizer`) under `transformers`' names."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    # -- text and ids -----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`, with the model's BOS first when `add_special_tokens` and the model
        adds one (as the engine encodes a text prompt)."""
        return self.tokenizer.encode(text, add_bos=None if add_special_tokens else False)

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Iterable[Iterable[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> Encoding:
        """``{"input_ids", "attention_mask"}`` of a text (also read as attributes, as
        `transformers`' ``BatchEncoding``), or lists of them for a list of texts."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return Encoding(input_ids=ids, attention_mask=[1] * len(ids))
        rows = [self.encode(t, add_special_tokens) for t in text]
        return Encoding(input_ids=rows, attention_mask=[[1] * len(r) for r in rows])

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self.tokenizer.tokens[ids]
        return [self.tokenizer.tokens[i] for i in ids]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | list[int] | None:
        """Each token's id (None for a token not in the vocabulary, as `transformers` gives
        for a tokenizer without an unknown token)."""
        index = self._ids
        if isinstance(tokens, str):
            return index.get(tokens)
        return [index.get(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return dict(self._ids)

    @functools.cached_property
    def _ids(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.tokenizer.tokens)}

    # -- chat -------------------------------------------------------------------------------
    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True,
                            return_dict: bool = False, **kwargs) -> str | list[int] | dict:
        """`conversation` by the model's chat template (or `chat_template`), as `transformers`:
        the text with ``tokenize=False``, else its ids (no BOS added: the template writes its
        own), or ``{"input_ids"}`` with `return_dict`; other keywords are template variables
        (``enable_thinking=False``, ...). Raises `InvalidRequest` for the keywords that shape
        tensors or masks (padding, truncation, return_tensors, ...), which have no use here."""
        refused = [k for k in _REFUSED if kwargs.get(k) not in (None, False)]
        if refused:
            raise InvalidRequest(f"apply_chat_template: {refused[0]} is not supported here (the result is plain text "
                                 "or a list of ids)", refused[0])
        extra = {k: v for k, v in kwargs.items() if k not in _REFUSED and k != "tokenizer_kwargs"}
        text = chat_prompt(self.tokenizer, list(conversation), None, chat_template, add_generation_prompt,
                           continue_final_message, tools, extra or None)
        if not tokenize:
            return text
        ids = self.tokenizer.encode(text, add_bos=False)
        return {"input_ids": ids} if return_dict else ids

    # -- special tokens and sizes -----------------------------------------------------------
    @property
    def chat_template(self) -> str | None:
        return self.tokenizer.chat_template

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self.tokenizer.bos_token_id

    @property
    def eos_token(self) -> str | None:
        t = self.tokenizer.eos_token_id
        return None if t is None else self.tokenizer.tokens[t]

    @property
    def bos_token(self) -> str | None:
        t = self.tokenizer.bos_token_id
        return None if t is None else self.tokenizer.tokens[t]

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self.tokenizer.special_ids)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def __len__(self) -> int:
        return self.tokenizer.vocab_size
