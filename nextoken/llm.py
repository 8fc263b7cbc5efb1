"""The offline Python API: ``LLM(model).generate(prompts, SamplingParams(...))``.

    from nextoken import LLM, SamplingParams
    llm = LLM("smollm2-135m-instruct")
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=20))
    print(out[0].outputs[0].text)
    for chunk in llm.stream("Tell me a joke", chat=True):
        print(chunk.outputs[0].delta, end="", flush=True)
"""

from __future__ import annotations

import itertools
from typing import Iterator, Sequence

from nextoken.catalog import DEFAULT_MODEL, resolve_model
from nextoken.engine.generate import generate_stream
from nextoken.errors import InvalidRequest
from nextoken.loader.gguf import GGUFFile
from nextoken.outputs import RequestOutput
from nextoken.runner.model_runner import ModelRunner, parse_dtype
from nextoken.sampling_params import SamplingParams
from nextoken.tokenizer import Tokenizer
from nextoken.tokenizer.chat_template import validate_messages

Prompt = str | list[int]


class LLM:
    """A model loaded for generation.

    model: a catalog name (pulled on first use when `auto_pull`) or a path to a ``.gguf`` file.
    dtype: ``"bfloat16"`` (default; fast on CPUs with AMX/AVX512-BF16) or ``"float32"`` (the exact
    reference, equal to `transformers` within 1e-4).
    reference_attention: use the plain attention implementation instead of the fused kernel.
    num_threads: PyTorch intra-op threads (default: PyTorch's choice, one per core).
    Raises `ModelLoadError` when the model cannot be found or read.
    """

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "bfloat16", reference_attention: bool = False,
                 auto_pull: bool = True, num_threads: int | None = None):
        import torch

        if num_threads:
            torch.set_num_threads(num_threads)
        self.model_path = resolve_model(model, auto_pull=auto_pull)
        self.model_name = model
        gguf = GGUFFile(self.model_path)
        self.tokenizer = Tokenizer.from_gguf(gguf)
        self.runner = ModelRunner(gguf, parse_dtype(dtype), reference=reference_attention)
        self.config = self.runner.config
        self._ids = itertools.count()

    # -- prompts ----------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], system: str | None = None) -> str:
        """The prompt text for a conversation, from the model's chat template. `system`, when
        given, is put first as a system message."""
        messages = validate_messages(list(messages))
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def encode_prompt(self, prompt: Prompt, params: SamplingParams, truncate: bool = False) -> list[int]:
        """Token ids of `prompt` (text, or ids already), fitted to the context window.

        Raises `InvalidRequest` when the prompt is empty, holds ids outside the vocabulary, or
        when prompt tokens plus max_tokens exceed the context length (naming both numbers) and
        `truncate` is False; with `truncate` the oldest prompt tokens are dropped instead.
        """
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
            if bad:
                raise InvalidRequest(f"prompt token id {bad[0]} is outside the vocabulary "
                                     f"[0, {self.config.vocab_size})", "prompt")
            ids = list(prompt)
        else:
            raise InvalidRequest("prompt must be a string or a list of token ids", "prompt")
        if not ids:
            raise InvalidRequest("prompt is empty", "prompt")
        ctx = self.config.context_length
        if len(ids) + params.max_tokens > ctx:
            if not truncate or params.max_tokens >= ctx:
                raise InvalidRequest(
                    f"prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}: "
                    f"{len(ids) + params.max_tokens} > the model's context length {ctx}; shorten the "
                    "prompt, lower max_tokens, or truncate the prompt (truncate_prompt)", "max_tokens")
            ids = ids[len(ids) + params.max_tokens - ctx :]
        return ids

    # -- generation -------------------------------------------------------------------------
    def stream(self, prompt: Prompt | list[dict], params: SamplingParams | None = None, chat: bool = False,
               system: str | None = None, truncate_prompt: bool = False, tracer=None) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding a `RequestOutput` after every token (each completion's
        `delta` is its new text). With `chat`, `prompt` is a message list or a user message."""
        params = (params or SamplingParams()).validate(self.config.vocab_size)
        text = None
        if chat:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            text = prompt = self.render_chat(messages, system)
        elif isinstance(prompt, str):
            text = prompt
        ids = self.encode_prompt(prompt, params, truncate_prompt)
        yield from generate_stream(self.runner, self.tokenizer, ids, params, str(next(self._ids)), text, tracer)

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 truncate_prompt: bool = False) -> list[RequestOutput]:
        """Complete each prompt (raw text or token ids); returns one finished `RequestOutput` per
        prompt, in order. `params` is one `SamplingParams` for all or one per prompt."""
        prompts = [prompts] if isinstance(prompts, str) or _is_ids(prompts) else list(prompts)
        per = _per_prompt(params, len(prompts))
        return [_last(self.stream(p, sp, truncate_prompt=truncate_prompt)) for p, sp in zip(prompts, per)]

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             system: str | None = None) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}``) or several (a list of
        such lists) with the model's chat template; returns one `RequestOutput` each."""
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        return [_last(self.stream(m, params, chat=True, system=system)) for m in convs]


def _is_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) for t in x)


def _per_prompt(params, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise InvalidRequest(f"got {len(params)} SamplingParams for {n} prompts", "params")
    return params


def _last(it):
    out = None
    for out in it:
        pass
    return out
