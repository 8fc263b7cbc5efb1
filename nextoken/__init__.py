"""nextoken: an LLM inference engine that shows every stage of the pipeline on real models."""

__version__ = "0.1.0"
