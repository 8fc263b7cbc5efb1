"""nextoken: an LLM inference engine that shows every stage of the pipeline on real models."""

__version__ = "0.1.0"

from nextoken.llm import LLM
from nextoken.outputs import CompletionOutput, RequestOutput
from nextoken.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
