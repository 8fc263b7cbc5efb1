"""Text <-> token ids: BPE, the chat template, the incremental detokenizer."""

from nextoken.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer"]
