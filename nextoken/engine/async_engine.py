"""`AsyncLLMEngine`: the engine's step loop in the background, one output stream per request.

The loop runs `LLMEngine.step` in a worker thread (PyTorch releases the GIL inside its kernels),
so the asyncio event loop stays free to accept requests and stream tokens. Always the same
thread: OpenMP gives every thread that starts parallel work a team of its own, and the idle
teams' threads spin for a while after their last step, taking the cores from the team at work
(steps handed to asyncio's default pool of threads ran SmolLM2 at 4.2-4.8 req/s with 2 threads
against 5.3-5.7 with 1; on one thread, 6.4 with 2: `benchmarks/serve.py --rate 8`). Requests to add or
abort are queued and applied by the loop between steps, so the engine is only ever touched from
one thread at a time. A consumer that stops iterating (a client that disconnects) aborts its
request, which frees its KV blocks at the next step. A consumer that falls behind the steps gets
the outputs waiting for it as one (`merge_outputs`: the deltas joined, the rest the newest's), as
vLLM's output collector does, so a loaded server sends fewer, larger chunks instead of falling
further behind. Those streams (`OutputStreams`) are shared with `core_client.EngineProcessClient`,
the client of an engine in a process of its own.
"""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, AsyncIterator

from nextoken.errors import EngineError, InvalidRequest, RequestFailed
from nextoken.outputs import RequestOutput
from nextoken.request_options import DEFAULT, RequestOptions
from nextoken.sampling_params import SamplingParams

if TYPE_CHECKING:  # (PyTorch comes with the engine: a server over an engine process imports neither)
    from nextoken.engine.engine import LLMEngine
    from nextoken.engine.view import EngineView


def merge_outputs(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """`newer` carrying `older`'s deltas too: each completion's ``delta`` and ``delta_token_ids``
    joined (older first); every cumulative field (text, token ids, log-probabilities, finish,
    metrics) is the newer snapshot's already. Changes and returns `newer`."""
    before = {c.index: c for c in older.outputs}
    for c in newer.outputs:
        o = before.get(c.index)
        if o is not None:
            c.delta = o.delta + c.delta
            c.delta_token_ids = o.delta_token_ids + c.delta_token_ids
    return newer


class OutputStreams:
    """One queue of outputs per request, and what reads them: `stream` (merging the outputs that
    waited, aborting the request when the consumer stops), `generate`, `beam_search`. The engine
    clients (`AsyncLLMEngine` here, `engine.core_client.EngineProcessClient` over a process)
    differ only in how a request reaches the engine (`_add`, `_add_beam`), how it is aborted
    (`abort`), and where the outputs come from (they call `_deliver` with each step's, `_stop`
    once the engine is gone)."""

    def __init__(self, id_prefix: str = ""):
        self._queues: dict[str, asyncio.Queue] = {}
        self._ids = itertools.count()
        self._id_prefix = id_prefix  # before the number of a request given no id (one front end of several: its own)
        self.dead: BaseException | None = None  # set once the engine has stopped
        self.on_dead = None  # called with the exception when the engine stops (the server's exit)

    async def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                          request_id: str | None = None, options: RequestOptions = DEFAULT) -> str:
        """Queue a request and return its id (`options`: see `LLMEngine.add_request`; kept hidden
        states come in the final output's ``prompt_hidden``). Raises `InvalidRequest` at once for
        bad input, `EngineError` if the engine has stopped."""
        rid = request_id if request_id is not None else f"async-{self._id_prefix}{next(self._ids)}"
        return await self._open(rid, lambda: self._add(prompt, params, rid, options))

    async def beam_search(self, prompt_ids: list[int], search, request_id: str | None = None,
                          options: RequestOptions = DEFAULT) -> RequestOutput:
        """Run `search` (a `beam.BeamSearch` over `prompt_ids`) in the engine's step loop
        (`LLMEngine.add_beam_search`): its final output, the beams as completions, best first.
        Cancelling the caller aborts it. Raises as `add_request` and `stream` do (`RequestFailed`
        when a beam's pass failed)."""
        rid = request_id if request_id is not None else f"beam-{self._id_prefix}{next(self._ids)}"
        await self._open(rid, lambda: self._add_beam(prompt_ids, search, rid, options))
        out = None
        async for out in self.stream(rid):
            pass
        return out

    async def _open(self, rid: str, add) -> str:
        """A queue for request `rid`, then ``await add()``; the queue goes again if that raises.
        Raises `InvalidRequest` when a request of that id is still streamed (its queue is kept)."""
        if self.dead is not None:
            raise EngineError(f"the engine loop has stopped: {self.dead!r}")
        if rid in self._queues:
            raise InvalidRequest(f"request id {rid!r} is already in use", "request_id")
        self._queues[rid] = asyncio.Queue()
        try:
            await add()
        except BaseException:
            self._queues.pop(rid, None)
            raise
        return rid

    async def stream(self, rid: str) -> AsyncIterator[RequestOutput]:
        """The outputs of request `rid` (from `add_request`) as they come; stopping early aborts
        the request. Raises `RequestFailed` when the request failed in the engine (its output then
        carries `RequestOutput.error`), `EngineError` when the engine loop has stopped."""
        queue = self._queues[rid]
        finished, held = False, None
        try:
            while not finished:
                item, held = (held if held is not None else await queue.get()), None
                while not isinstance(item, BaseException) and not item.finished and not queue.empty():
                    newer = queue.get_nowait()  # (outputs that waited: one chunk)
                    if isinstance(newer, BaseException):
                        held = newer
                        break
                    item = merge_outputs(item, newer)
                if isinstance(item, BaseException):
                    raise EngineError(f"the engine loop has stopped: {item!r}")
                finished = item.finished
                if item.error is not None:
                    raise RequestFailed(item.error)
                yield item
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.abort(rid)

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, options: RequestOptions = DEFAULT) -> AsyncIterator[RequestOutput]:
        """`add_request` then `stream`."""
        rid = await self.add_request(prompt, params, request_id, options)
        async for out in self.stream(rid):
            yield out

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their requests' queues (a request nobody streams any more: dropped)."""
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _stop(self, exc: BaseException) -> None:
        """The engine is gone: every waiting stream raises, `on_dead` is told."""
        self.dead = exc
        for q in self._queues.values():
            q.put_nowait(exc)
        if self.on_dead is not None:
            self.on_dead(exc)

    @property
    def is_running(self) -> bool:
        return self.dead is None


class AsyncLLMEngine(OutputStreams):
    """An `LLMEngine` stepped in the background: the server's `engine.protocol.EngineClient`."""

    def __init__(self, engine: LLMEngine, stepper: ThreadPoolExecutor | None = None):
        """`stepper`: the one-thread executor the steps run in (default: a new one); the server
        passes the one that loaded and warmed the model, so a single OpenMP team ever works."""
        super().__init__()
        self._engine = engine
        self._pending_aborts: list[str] = []
        self._lock = asyncio.Lock()  # held while the engine is touched (a step, an add, an abort)
        self._wakeup = asyncio.Event()  # set when there is work for the loop
        self._loop_task: asyncio.Task | None = None
        self._stepper = stepper or ThreadPoolExecutor(max_workers=1, thread_name_prefix="nextoken-step")

    async def _add(self, prompt, params, rid: str, options: RequestOptions) -> None:
        await self.between_steps(lambda: self._engine.add_request(prompt, params, rid, options))
        self._ensure_loop()

    async def _add_beam(self, prompt_ids: list[int], search, rid: str, options: RequestOptions) -> None:
        await self.between_steps(lambda: self._engine.add_beam_search(prompt_ids, search, rid, options))
        self._ensure_loop()

    async def load_lora(self, lora_request) -> int:
        """`LLMEngine.load_lora` between steps: the adapter's id."""
        return await self.between_steps(lambda: self._engine.load_lora(lora_request))

    async def unload_lora(self, lora_id: int) -> None:
        """`LLMEngine.unload_lora` between steps."""
        await self.between_steps(lambda: self._engine.unload_lora(lora_id))

    @property
    def num_waiting(self) -> int:
        return len(self._engine.scheduler.waiting)

    # -- the model and the checks made before a request is queued (`engine.protocol.EngineClient`)
    @property
    def tokenizer(self):
        return self._engine.tokenizer

    @property
    def config(self):
        """The model's `ModelConfig`."""
        return self._engine.config

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def watermark(self):
        return self._engine.watermark

    @property
    def model_path(self):
        """The model's file or folder."""
        return self._engine.model_path

    @property
    def kv_capacity(self) -> int:
        """The tokens the KV cache holds (its blocks times the block size)."""
        return self._engine.kv.pool.num_blocks * self._engine.kv.block_size

    @property
    def sampling_defaults(self) -> dict:
        """The model's sampling defaults (`nextoken.sampling_defaults`)."""
        return self._engine.sampling_defaults

    @property
    def max_logprobs(self) -> int:
        """The most log-probabilities a request may ask for (-1: the vocabulary)."""
        return self._engine.max_logprobs

    def compile_grammar(self, structured) -> None:
        """Compile (and cache) a request's grammar; blocking. Raises `InvalidRequest`."""
        self._engine.grammars.compile(structured)

    def encode_prompt(self, prompt: str | list[int], params: SamplingParams, truncate: bool = False) -> list[int]:
        """`LLMEngine.encode_prompt`: the prompt's ids; raises `InvalidRequest` when it does not fit."""
        return self._engine.encode_prompt(prompt, params, truncate)

    def scheduler_stats(self):
        return self._engine.scheduler_stats()

    def subscribe(self, subscriber) -> None:
        """`LLMEngine.subscribe`: `subscriber(StepStats)` after each step, on the stepping thread."""
        self._engine.subscribe(subscriber)

    def view(self) -> EngineView:
        """The inspector's read-only `EngineView` of the engine."""
        from nextoken.engine.view import EngineView

        return EngineView(self._engine)

    def abort(self, request_id: str) -> None:
        """Abort a request at the next step boundary (frees its blocks)."""
        self._pending_aborts.append(request_id)
        self._wakeup.set()

    # -- the loop ---------------------------------------------------------------------------
    async def between_steps(self, fn):
        """`fn()`'s value, run between two engine steps (under the lock the step loop takes):
        adds, aborts, adapter loads and the inspector's reads of the engine's state."""
        async with self._lock:
            return fn()

    def _ensure_loop(self) -> None:
        self._wakeup.set()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())

    async def _run_loop(self) -> None:
        try:
            while True:
                async with self._lock:
                    while self._pending_aborts:
                        self._engine.abort_request(self._pending_aborts.pop())
                    if not self._engine.has_unfinished_requests():
                        self._wakeup.clear()
                        outputs = None
                    else:
                        outputs = await asyncio.get_running_loop().run_in_executor(self._stepper, self._engine.step)
                if outputs is None:
                    await self._wakeup.wait()
                    continue
                self._deliver(outputs)
                await asyncio.sleep(0)  # let consumers run between steps
        except Exception as exc:  # the engine is broken: tell every waiting request
            self._stop(exc)

    def close(self) -> None:
        """Free the engine (`LLMEngine.close`: the disk tier's writes, the tensor-parallel group)."""
        self._engine.close()
