"""Which model class implements which architecture."""

from __future__ import annotations

from nextoken.errors import ModelLoadError
from nextoken.models.gemma3 import Gemma3ForCausalLM
from nextoken.models.gpt2 import GPT2LMHeadModel
from nextoken.models.llama import LlamaForCausalLM
from nextoken.models.mistral import MistralForCausalLM
from nextoken.models.qwen2 import Qwen2ForCausalLM
from nextoken.models.qwen3 import Qwen3ForCausalLM

# GGUF `general.architecture` (and `loader.hf.HF_ARCHITECTURES`' names) -> class
ARCHITECTURES = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "mistral": MistralForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "gpt2": GPT2LMHeadModel,
}


def model_class(architecture: str):
    """The class for `architecture`; `ModelLoadError` listing the supported ones otherwise."""
    if architecture not in ARCHITECTURES:
        raise ModelLoadError(
            f"model architecture {architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    return ARCHITECTURES[architecture]
