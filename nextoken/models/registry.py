"""Which model class implements which architecture."""

from __future__ import annotations

from nextoken.errors import ModelLoadError
from nextoken.models.llama import LlamaForCausalLM
from nextoken.models.qwen2 import Qwen2ForCausalLM

# GGUF `general.architecture` -> class
ARCHITECTURES = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
}


def model_class(architecture: str):
    """The class for `architecture`; `ModelLoadError` listing the supported ones otherwise."""
    if architecture not in ARCHITECTURES:
        raise ModelLoadError(
            f"model architecture {architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    return ARCHITECTURES[architecture]
