"""Text <-> token ids: the BPE tokenizer, the chat template and the incremental detokenizer."""

from nextoken.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer"]
