"""nextoken: an LLM inference engine that shows every stage of the pipeline on real models.

    from nextoken import LLM, SamplingParams

The names below are imported on first use (PEP 562), so ``import nextoken`` and the command
line's ``--help`` and ``models`` do not import torch.
"""

__version__ = "0.1.0"

_LAZY = {
    "LLM": "nextoken.llm",
    "EngineArgs": "nextoken.engine_args",
    "SamplingParams": "nextoken.sampling_params",
    "RequestOutput": "nextoken.outputs",
    "CompletionOutput": "nextoken.outputs",
    "LoRARequest": "nextoken.lora",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nextoken' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
