"""The offline Python API: ``LLM(model).generate(prompts, SamplingParams(...))``.

    from nextoken import LLM, SamplingParams
    llm = LLM("smollm2-135m-instruct")
    outs = llm.generate(["The capital of France is", "def fib(n):"], SamplingParams(temperature=0))
    for chunk in llm.stream("Tell me a joke", chat=True):
        print(chunk.outputs[0].delta, end="", flush=True)

`generate` hands every prompt to the continuous-batching engine at once.
"""

from __future__ import annotations

import functools
from typing import Iterator, Sequence

from nextoken.beam import BeamSearchOutput, beam_search
from nextoken.catalog import DEFAULT_MODEL
from nextoken.engine.engine import LLMEngine
from nextoken.engine_args import EngineArgs
from nextoken.errors import InvalidRequest, RequestFailed
from nextoken.loader.opened import OpenedModel
from nextoken.outputs import (EmbeddingOutput, EmbeddingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput,
                              with_vllm_logprobs)
from nextoken.request_options import RequestOptions
from nextoken.sampling_params import SamplingParams
from nextoken.tokenizer.chat_template import chat_prompt
from nextoken.tokenizer.hf_style import HFStyleTokenizer

Prompt = str | list[int] | dict  # text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}


class LLM:
    """A model loaded for generation.

    ``LLM(model, **options)``: `model` is a catalog name (pulled on first use unless
    ``auto_pull=False``), a path to a ``.gguf`` file or to a Hugging Face model folder, or a hub
    id ``org/name`` (found in the `huggingface_hub` cache). Every other keyword is an engine
    option: a field of `nextoken.engine_args.EngineArgs`, which defines each one once (its
    default, its meaning, its command-line flag: the README's engine-options table is generated
    from it). ``LLM(model, dtype="float32")`` is the exact reference, equal to `transformers`
    within 1e-4.

    Raises `InvalidRequest` naming an option whose value is out of range, `TypeError` for an
    unknown option, and `ModelLoadError` when the model cannot be found or read.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **options):
        self._setup(EngineArgs(model=model, **options))

    @classmethod
    def from_engine_args(cls, args: EngineArgs, first=None) -> LLM:
        """An `LLM` built from `EngineArgs` (what the command line does). `first`: the first
        tokens ``nextoken run`` computed before PyTorch was imported
        (`runner.quick_start.FirstTokens`): the model file and tokenizer it read are reused;
        `stream(..., first=first)` then goes on after them."""
        llm = cls.__new__(cls)
        llm._setup(args, first.opened if first is not None else None)
        return llm

    def _setup(self, args: EngineArgs, opened: OpenedModel | None = None) -> None:
        from nextoken.catalog import is_embedding_model, resolve_model
        from nextoken.embedding import EmbeddingModel, encoder_dtype

        self.engine_args = args
        self.model_name = args.model
        self.embedder = None
        if opened is None:
            path = resolve_model(args.model, auto_pull=args.auto_pull)
            if is_embedding_model(path):  # an encoder: `embed` only
                from nextoken.runner.device import resolve_device

                device = resolve_device(args.device).torch
                self.embedder = EmbeddingModel(path, encoder_dtype(args.dtype, device), quantization=args.quantization,
                                               device=device, enforce_eager=args.enforce_eager)
                self.engine, self.tokenizer, self.runner, self.config = None, None, None, None
                self.model_path = str(path)
                return
        self.engine = LLMEngine.from_engine_args(args, opened)
        self.model_path = self.engine.model_path
        self.tokenizer = self.engine.tokenizer
        self.runner = self.engine.runner
        self.config = self.engine.config

    def close(self) -> None:
        """Stop the tensor-parallel ranks this `LLM` started (`LLMEngine.close`; also done at
        exit). `with LLM(...) as llm:` closes on leaving the block."""
        if self.engine is not None:
            self.engine.close()

    # -- embeddings -------------------------------------------------------------------------
    def embed(self, inputs: str | list[int] | Sequence[str | list[int]], truncate: bool = False,
              dimensions: int | None = None, truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per input (a text, or token ids used as given), with an embedding model
        (``LLM("all-minilm-l6-v2")``: `nextoken.embedding`). `truncate`: cut an input longer than
        the model takes; `truncate_prompt_tokens` (vLLM's): cut each to at most that many tokens
        (-1: the model's length). Raises `InvalidRequest` for an empty input, one longer than the
        model takes (unless cut), `dimensions` the model cannot give, or a model that generates
        text."""
        if truncate_prompt_tokens is not None:
            truncate = truncate_prompt_tokens
        if self.embedder is None:
            raise InvalidRequest(f"model {self.model_name!r} generates text; embeddings need an embedding model "
                                 "(e.g. LLM('all-minilm-l6-v2'))", "model")
        batch = [inputs] if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)) else list(inputs)
        out = self.embedder.embed(batch, truncate, dimensions)
        return [EmbeddingRequestOutput(str(i), ids, EmbeddingOutput(v.tolist()))
                for i, (ids, v) in enumerate(zip(out.token_ids, out.vectors))]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str],
              truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """vLLM's: how close each text of `data_2` is to `data_1` (one text against them all, or
        pair by pair for as many), as the cosine similarity of the embedding model's vectors
        (`embedding.cosine_scores`; the server's ``/v1/score``). Raises `InvalidRequest` as
        `embed` does, and for sides of different lengths."""
        from nextoken.embedding import cosine_scores, score_pairs

        if self.embedder is None:
            raise InvalidRequest(f"model {self.model_name!r} generates text; scores need an embedding model "
                                 "(e.g. LLM('all-minilm-l6-v2'))", "model")
        a = [data_1] if isinstance(data_1, str) else list(data_1)
        b = [data_2] if isinstance(data_2, str) else list(data_2)
        score_pairs(a, b, "data_1", "data_2")
        out = self.embedder.embed(a + b, False if truncate_prompt_tokens is None else truncate_prompt_tokens)
        sims = cosine_scores(out.vectors[: len(a)], out.vectors[len(a):])
        ids = out.token_ids
        return [ScoringRequestOutput(str(i), ids[0 if len(a) == 1 else i] + ids[len(a) + i], ScoringOutput(s))
                for i, s in enumerate(sims)]

    def _generation(self) -> LLMEngine:
        if self.engine is None:
            raise InvalidRequest(f"model {self.model_name!r} is an embedding model: it does not generate text; use "
                                 "LLM.embed", "model")
        return self.engine

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- prompts ----------------------------------------------------------------------------
    def get_tokenizer(self) -> HFStyleTokenizer:
        """The model's tokenizer under `transformers`' names (vLLM's method): `encode`,
        `decode`, ``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``,
        `eos_token_id`, ... (`tokenizer.hf_style.HFStyleTokenizer`)."""
        return HFStyleTokenizer(self.tokenizer)

    def render_chat(self, messages: list[dict], system: str | None = None) -> str:
        """The prompt text for a conversation, from the model's chat template. `system`, when
        given, is put first as a system message."""
        return chat_prompt(self.tokenizer, list(messages), system)

    def _chat_prompt(self, prompt, system) -> str:
        return chat_prompt(self.tokenizer, prompt, system)

    # -- generation -------------------------------------------------------------------------
    def stream(self, prompt: Prompt | list[dict], sampling_params: SamplingParams | None = None, chat: bool = False,
               system: str | None = None, truncate_prompt: bool = False, tracer=None,
               first=None) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding a `RequestOutput` whenever it has new text (each
        completion's `delta`). With `chat`, `prompt` is a message list or a user message.
        `tracer` (see `nextoken.trace`) records every stage of this request. `first`: the quick
        start's first tokens of this prompt (`runner.quick_start.FirstTokens`): the request is its
        prompt ids, those tokens come out first without draws and the seeded stream goes on past
        the numbers they used, so the output is what `generate` gives for the prompt (the first
        tokens included). Raises `RequestFailed` when the model's pass for it produced
        non-finite logits."""
        first_tokens = None
        if first is not None:
            prompt, chat, first_tokens = first.prompt_ids, False, (tuple(first.tokens), first.draws)
        if chat:
            prompt = self._chat_prompt(prompt, system)
        engine = self._generation()
        rid = None
        try:
            params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
            rid = engine.add_request(prompt, params, options=RequestOptions(
                truncate_prompt=truncate_prompt, tracer=tracer, first_tokens=first_tokens))
            done = False
            while not done:
                for out in engine.step():
                    if out.request_id == rid:
                        done = out.finished
                        if out.error is not None:
                            raise RequestFailed(out.error)
                        yield out
        finally:
            if rid is not None:
                engine.abort_request(rid)  # a no-op once finished; frees the blocks if abandoned

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = False,
                 lora_request=None, priority: Sequence[int] | None = None,
                 truncate_prompt: bool = False) -> list[RequestOutput]:
        """Complete every prompt (raw text, token ids, or vLLM's prompt dictionaries
        ``{"prompt": text}`` and ``{"prompt_token_ids": ids}``, either with a ``"cache_salt"``:
        `RequestOptions.cache_salt`), all batched together; returns one
        finished `RequestOutput` per prompt, in order (vLLM's signature). `sampling_params` is
        one `SamplingParams` for all or one per prompt (None: `get_default_sampling_params`);
        `use_tqdm`: a progress bar of the prompts done, on standard error; `lora_request` one
        `lora.LoRARequest` for all, or one (or None, the base model) per prompt (with
        ``enable_lora=True``). Every prompt is checked before any runs; a dictionary of another
        form raises `InvalidRequest`. A prompt whose pass produced non-finite logits comes back
        with `RequestOutput.error` set and finish reason ``"error"``; the others complete.
        `priority`: one per prompt, lower first (needs ``scheduling_policy="priority"``)."""
        single = isinstance(prompts, (str, dict)) or _is_ids(prompts)
        pairs = [_plain_prompt(p) for p in ([prompts] if single else list(prompts))]
        prompts, salts = [p for p, _ in pairs], [salt for _, salt in pairs]
        loras = _per_prompt_loras(lora_request, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise InvalidRequest(f"{len(priority)} priorities for {len(prompts)} prompts", "priority")
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        return self._run_all(prompts, _per_prompt(params, len(prompts)), truncate_prompt, loras, priority, use_tqdm,
                             salts)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefixes cached in memory, so the next prompts are computed in full (vLLM's
        ``LLM.reset_prefix_cache``); False, changing nothing, while a request (a stream's) is still
        unfinished. A disk tier (``kv_disk_dir``) keeps its blocks."""
        return self.engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """The `SamplingParams` that `generate`, `chat` and `stream` use when given none (vLLM's
        method): the defaults, with the model's own where its folder recommends some
        (``generation_config.json``; `nextoken.sampling_defaults`)."""
        return SamplingParams(**self._generation().sampling_defaults)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], beam_width: int, max_tokens: int,
                    length_penalty: float = 1.0, ignore_eos: bool = False) -> list[BeamSearchOutput]:
        """Beam search (as `transformers`' ``num_beams``, see `nextoken.beam`) for each prompt
        (raw text or token ids), every prompt's beams batched in the engine each step; returns
        one `BeamSearchOutput` per prompt with its beams, best score first."""
        prompts = [prompts] if isinstance(prompts, str) or _is_ids(prompts) else list(prompts)
        engine = self._generation()
        params = SamplingParams(max_tokens=max_tokens).validate(self.config.vocab_size)
        encoded = [engine.encode_prompt(p, params) for p in prompts]
        return beam_search(engine, encoded, beam_width, max_tokens, length_penalty, ignore_eos)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = False,
             lora_request=None, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, system: str | None = None) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}``) or several (a list of
        such lists), batched; returns one `RequestOutput` each (vLLM's signature; `generate`'s
        arguments). `chat_template`: a Jinja source used instead of the model's;
        `continue_final_message` (with `add_generation_prompt` False): the answer goes on from
        the last message's text; `tools`: OpenAI function tools for the template;
        `chat_template_kwargs`: more template variables (``enable_thinking``, ...); `system`: a
        system message put first (`tokenizer.chat_template.chat_prompt`)."""
        self._generation()
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [chat_prompt(self.tokenizer, m, system, chat_template, add_generation_prompt, continue_final_message,
                               tools, chat_template_kwargs) for m in convs]
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        return self._run_all(prompts, _per_prompt(params, len(prompts)), False,
                             _per_prompt_loras(lora_request, len(prompts)), None, use_tqdm)

    def _run_all(self, prompts, params, truncate, loras=None, priority=None, use_tqdm=False,
                 salts=None) -> list[RequestOutput]:
        engine = self._generation()
        encoded = [engine.encode_prompt(p, (sp or SamplingParams()).validate(self.config.vocab_size, engine.max_logprobs),
                                        truncate)
                   for p, sp in zip(prompts, params)]  # check every prompt first: one bad prompt runs none
        loras = loras or [None] * len(prompts)
        ids = []
        try:
            for e, p, sp, lora, prio, salt in zip(encoded, prompts, params, loras, priority or [0] * len(prompts),
                                                  salts or [None] * len(prompts)):
                ids.append(engine.add_request(e, sp, options=RequestOptions(
                    prompt_text=p if isinstance(p, str) else None, lora_request=lora, priority=prio, final_only=True,
                    cache_salt=salt)))
        except Exception:  # one bad adapter: none of the prompts run
            for rid in ids:
                engine.abort_request(rid)
            raise
        if not use_tqdm:
            outs = engine.run_until_finished(ids)
        else:
            from tqdm import tqdm

            with tqdm(total=len(ids), desc="Processed prompts", unit="prompt", dynamic_ncols=True) as bar:
                outs = engine.run_until_finished(ids, on_finished=lambda out: bar.update())
        text = functools.lru_cache(maxsize=None)(self.tokenizer.token_text)
        return [with_vllm_logprobs(o, sp.logprobs, sp.prompt_logprobs, text)
                if sp.logprobs is not None or sp.prompt_logprobs is not None else o for o, sp in zip(outs, params)]


def _plain_prompt(p) -> tuple:
    """A vLLM prompt dictionary as text or ids and its cache salt (or None); text and ids as
    they are, without a salt."""
    if not isinstance(p, dict):
        return p, None
    keys = set(p) - {"cache_salt"}
    if keys == {"prompt"}:
        return p["prompt"], p.get("cache_salt")
    if keys == {"prompt_token_ids"}:
        return list(p["prompt_token_ids"]), p.get("cache_salt")
    raise InvalidRequest(f"a prompt dictionary takes 'prompt' (text) or 'prompt_token_ids' (ids), and "
                         f"'cache_salt', not {sorted(p)}", "prompts")


def _is_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) for t in x)


def _per_prompt_loras(lora_request, n: int) -> list:
    """One adapter (or None) for each of `n` prompts: `lora_request` for all, or a list of one each."""
    loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * n
    if len(loras) != n:
        raise InvalidRequest(f"{len(loras)} lora requests for {n} prompts", "lora_request")
    return loras


def _per_prompt(params, n: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise InvalidRequest(f"got {len(params)} SamplingParams for {n} prompts", "params")
    return params
