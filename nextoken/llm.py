"""The offline Python API: ``LLM(model).generate(prompts, SamplingParams(...))``.

    from nextoken import LLM, SamplingParams
    llm = LLM("smollm2-135m-instruct")
    outs = llm.generate(["The capital of France is", "def fib(n):"], SamplingParams(temperature=0))
    for chunk in llm.stream("Tell me a joke", chat=True):
        print(chunk.outputs[0].delta, end="", flush=True)

`generate` hands every prompt to the continuous-batching engine at once.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from nextoken.beam import BeamSearchOutput, beam_search
from nextoken.catalog import DEFAULT_MODEL, resolve_model
from nextoken.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from nextoken.engine.engine import LLMEngine
from nextoken.errors import InvalidRequest
from nextoken.loader.source import model_dtype, open_model
from nextoken.outputs import RequestOutput
from nextoken.sampling_params import SamplingParams
from nextoken.tokenizer.chat_template import validate_messages

Prompt = str | list[int]


class LLM:
    """A model loaded for generation.

    model: a catalog name (pulled on first use when `auto_pull`), a path to a ``.gguf`` file or
    to a Hugging Face model folder, or a hub id ``org/name`` (found in the `huggingface_hub` cache).
    dtype: ``"auto"`` (default: bfloat16 for GGUF, the config's dtype for a folder),
    ``"bfloat16"`` (fast on CPUs with AMX/AVX512-BF16) or ``"float32"`` (the exact reference,
    equal to `transformers` within 1e-4).
    kv_cache_memory: bytes for the paged KV cache (default: a quarter of free memory, at most
    4 GiB); block_size: tokens per KV block; enable_prefix_caching: reuse the KV of shared
    prompt prefixes; max_num_seqs / max_num_batched_tokens: per-step limits;
    enable_chunked_prefill: split long prompts over steps; max_model_len: most tokens per
    sequence (prompt + output; default the model's context length), which also bounds the
    default KV cache. num_threads: compute threads (default one per core the process may use);
    enforce_eager: PyTorch only, none of our native kernels (`nextoken.kernels`): the reference
    path (None: leave the process-wide setting, ``NEXTOKEN_ENFORCE_EAGER``, as it is).
    dense_weights: on PyTorch's int4 path (``enforce_eager``), keep a bf16 copy of the
    quantized weights for calls of many rows (about 4x the weight memory; default off). Our
    quantized kernel serves every call itself and never keeps one.
    speculative_model (a draft model with the same vocabulary) or speculative_method="ngram"
    (prompt lookup) turn on speculative decoding with up to num_speculative_tokens drafted
    tokens per step (`nextoken.spec`).
    Raises `ModelLoadError` when the model cannot be found or read.
    """

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "auto", reference_attention: bool = False,
                 auto_pull: bool = True, num_threads: int | None = None, kv_cache_memory: int | None = None,
                 num_kv_blocks: int = 0, block_size: int = 16, enable_prefix_caching: bool = True,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048, enable_chunked_prefill: bool = True,
                 max_model_len: int | None = None, enforce_eager: bool | None = None,
                 dense_weights: bool | None = None, speculative_model: str | None = None,
                 speculative_method: str | None = None, num_speculative_tokens: int = 4):
        from nextoken.kernels import set_enforce_eager
        from nextoken.runner.threads import configure_threads

        configure_threads(num_threads)
        if enforce_eager is not None:
            set_enforce_eager(enforce_eager)
        self.model_path = resolve_model(model, auto_pull=auto_pull)
        self.model_name = model
        spec, draft = None, None
        if speculative_model is not None or speculative_method is not None:
            method = speculative_method or "draft"
            if method == "draft" and speculative_model is None:
                raise InvalidRequest("speculative method 'draft' needs speculative_model", "speculative_model")
            if method == "ngram" and speculative_model is not None:
                raise InvalidRequest("speculative method 'ngram' takes no speculative_model", "speculative_model")
            spec = SpeculativeConfig(method, speculative_model, num_speculative_tokens)
            if method == "draft":
                draft = open_model(resolve_model(speculative_model, auto_pull=auto_pull))
        source = open_model(self.model_path)
        self.engine = LLMEngine(
            source, model_dtype(source, dtype),
            CacheConfig(block_size, num_kv_blocks, kv_cache_memory, enable_prefix_caching),
            SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, max_model_len),
            reference_attention, dense_weights, spec, draft)
        self.tokenizer = self.engine.tokenizer
        self.runner = self.engine.runner
        self.config = self.engine.config

    # -- prompts ----------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], system: str | None = None) -> str:
        """The prompt text for a conversation, from the model's chat template. `system`, when
        given, is put first as a system message."""
        messages = validate_messages(list(messages))
        if system is not None:
            messages = [{"role": "system", "content": system}, *messages]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def _chat_prompt(self, prompt, system) -> str:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return self.render_chat(messages, system)

    # -- generation -------------------------------------------------------------------------
    def stream(self, prompt: Prompt | list[dict], params: SamplingParams | None = None, chat: bool = False,
               system: str | None = None, truncate_prompt: bool = False, tracer=None) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding a `RequestOutput` whenever it has new text (each
        completion's `delta`). With `chat`, `prompt` is a message list or a user message.
        `tracer` (see `nextoken.trace`) records every stage; it needs the engine to itself."""
        if chat:
            prompt = self._chat_prompt(prompt, system)
        engine = self.engine
        if tracer is not None and engine.has_unfinished_requests():
            raise InvalidRequest("tracing needs the engine to itself", "tracer")
        engine.tracer = tracer
        rid = None
        try:
            rid = engine.add_request(prompt, params, truncate_prompt=truncate_prompt)
            done = False
            while not done:
                for out in engine.step():
                    if out.request_id == rid:
                        done = out.finished
                        yield out
        finally:
            engine.tracer = None
            if rid is not None:
                engine.abort_request(rid)  # a no-op once finished; frees the blocks if abandoned

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 truncate_prompt: bool = False) -> list[RequestOutput]:
        """Complete every prompt (raw text or token ids), all batched together; returns one
        finished `RequestOutput` per prompt, in order. `params` is one `SamplingParams` for all
        or one per prompt. Every prompt is checked before any runs."""
        prompts = [prompts] if isinstance(prompts, str) or _is_ids(prompts) else list(prompts)
        return self._run_all(prompts, _per_prompt(params, len(prompts)), truncate_prompt)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], beam_width: int, max_tokens: int,
                    length_penalty: float = 1.0, ignore_eos: bool = False) -> list[BeamSearchOutput]:
        """Beam search (as `transformers`' ``num_beams``, see `nextoken.beam`) for each prompt
        (raw text or token ids), every prompt's beams batched in the engine each step; returns
        one `BeamSearchOutput` per prompt with its beams, best score first."""
        prompts = [prompts] if isinstance(prompts, str) or _is_ids(prompts) else list(prompts)
        params = SamplingParams(max_tokens=max_tokens).validate(self.config.vocab_size)
        encoded = [self.engine.encode_prompt(p, params) for p in prompts]
        return beam_search(self.engine, encoded, beam_width, max_tokens, length_penalty, ignore_eos)

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | Sequence[SamplingParams] | None = None,
             system: str | None = None) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}``) or several (a list of
        such lists), batched; returns one `RequestOutput` each."""
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self._chat_prompt(m, system) for m in convs]
        return self._run_all(prompts, _per_prompt(params, len(prompts)), False)

    def _run_all(self, prompts, params, truncate) -> list[RequestOutput]:
        engine = self.engine
        encoded = [engine.encode_prompt(p, (sp or SamplingParams()).validate(self.config.vocab_size), truncate)
                   for p, sp in zip(prompts, params)]  # check every prompt first: one bad prompt runs none
        ids = [engine.add_request(e, sp, prompt_text=p if isinstance(p, str) else None)
               for e, p, sp in zip(encoded, prompts, params)]
        return engine.run_until_finished(ids)


def _is_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) for t in x)


def _per_prompt(params, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise InvalidRequest(f"got {len(params)} SamplingParams for {n} prompts", "params")
    return params
