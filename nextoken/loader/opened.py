"""A model file read once and handed on (torch-free): the first token of ``nextoken run``
(`runner.quick_start`) reads the GGUF file and builds its tokenizer before PyTorch is imported;
the engine then takes them over instead of reading them again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nextoken.loader.gguf import GGUFFile
    from nextoken.tokenizer import Tokenizer


@dataclass(frozen=True)
class OpenedModel:
    """The opened GGUF file of ``EngineArgs.model`` and its tokenizer."""

    source: GGUFFile
    tokenizer: Tokenizer
