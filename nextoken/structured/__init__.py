"""Structured output: generation held to a JSON schema, a regex, a choice or a grammar.

`params.StructuredOutputsParams` says what a request asks for; `backend` compiles it with
llguidance over the model's vocabulary and keeps one matcher per sequence. The sampler masks
the disallowed tokens (`Sampler.distribution`), after penalties and before temperature.
"""

from nextoken.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
