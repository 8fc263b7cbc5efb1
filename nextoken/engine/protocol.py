"""What the server and the inspector may ask of a model they serve, declared in one place (as
vLLM's ``engine/protocol.py``): `Service`, what every served model is (a generation engine, the
embedding service), `EngineClient`, all that the API routes, the chat core and the inspector
use of the generation engine, and `PoolingClient`, what the pooling routes use of the embedding
service. `AsyncLLMEngine` implements it, and `core_client.EngineProcessClient` over an engine in
a process of its own (whose `view` and `between_steps` raise: the inspector needs the engine in
the server's process); the server holds an `EngineClient`
and never reaches past it into the `LLMEngine` it wraps (kept private: tests/cli/test_layout.py
refuses a private name read across parts), so a test drives the chat core with a fake client
(tests/server/test_chat_core.py), and another engine (a remote one, a GPU worker) needs only these
members."""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:
    from nextoken.engine.view import EngineView
    from nextoken.outputs import RequestOutput
    from nextoken.request_options import RequestOptions
    from nextoken.sampling_params import SamplingParams


@runtime_checkable
class Service(Protocol):
    """A model the server serves: whether its loop runs, the exception that stopped it (None
    while it runs), and `close` (stop it, free what it holds)."""

    @property
    def is_running(self) -> bool: ...

    @property
    def dead(self) -> BaseException | None: ...

    def close(self) -> None: ...


@runtime_checkable
class EngineClient(Service, Protocol):
    """The generation engine as the server sees it. Requests: `add_request` (raises
    `InvalidRequest` for bad input, `EngineError` once the loop died), `stream` (the request's
    outputs, cumulative; aborts it if the consumer stops), `generate` (both), `abort`,
    `beam_search` (a `beam.BeamSearch` the engine drives: its final output), `num_waiting`. The
    model: `tokenizer`, `config` (the `ModelConfig`), `max_model_len`, `watermark` (its
    `WatermarkConfig`), `model_path`, `kv_capacity` (tokens the KV cache holds),
    `sampling_defaults` (the model's, for requests that leave a field unset:
    `nextoken.sampling_defaults`), `max_logprobs` (the most log-probabilities a request may ask
    for; -1: the vocabulary). Checks made
    before a request is queued: `compile_grammar` (blocking: call it in a worker thread; raises
    `InvalidRequest`) and `encode_prompt` (the prompt's ids; raises `InvalidRequest` when it does
    not fit). Observation: `scheduler_stats`, `subscribe` (a callable given each step's
    `StepStats` on the stepping thread), `view` (the inspector's read-only `EngineView`),
    `between_steps` (run a function between two steps).
    Adapters: `load_lora`, `unload_lora`."""

    @property
    def tokenizer(self): ...

    @property
    def config(self): ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def watermark(self): ...

    @property
    def model_path(self): ...

    @property
    def kv_capacity(self) -> int: ...

    @property
    def sampling_defaults(self) -> dict: ...

    @property
    def max_logprobs(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    async def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                          request_id: str | None = None, options: RequestOptions = ...) -> str: ...

    def stream(self, rid: str) -> AsyncIterator[RequestOutput]: ...

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                 request_id: str | None = None, options: RequestOptions = ...) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    async def beam_search(self, prompt_ids: list[int], search, request_id: str | None = None,
                          options: RequestOptions = ...) -> RequestOutput: ...

    def compile_grammar(self, structured) -> None: ...

    def encode_prompt(self, prompt: str | list[int], params: SamplingParams, truncate: bool = False) -> list[int]: ...

    def scheduler_stats(self): ...

    def subscribe(self, subscriber: Callable) -> None: ...

    def view(self) -> EngineView: ...

    async def between_steps(self, fn): ...

    async def load_lora(self, lora_request) -> int: ...

    async def unload_lora(self, lora_id: int) -> None: ...


@runtime_checkable
class PoolingClient(Service, Protocol):
    """The embedding model as the pooling routes see it (vLLM's ``encode`` side of its engine
    client): `embed` (the inputs' vectors, `embedding.Embeddings`; raises `InvalidRequest` naming
    a bad input), `model` (its `embedding.EmbeddingModel`: tokenizer, limits, dimensions), and the
    totals /metrics reads (`num_requests`, `num_tokens`, `num_passes`). The server's
    `EmbeddingService` implements it."""

    model: object
    num_requests: int
    num_tokens: int
    num_passes: int

    async def embed(self, inputs: list, truncate: bool = False): ...
