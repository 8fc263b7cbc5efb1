"""What the inspector's routes (`inspect.routes`, `inspect.measure_routes`) share: the engine
behind the app and the inspector's memory, kept on ``app.state.inspector``."""

from __future__ import annotations

import asyncio
import itertools

from cachetools import LRUCache
from fastapi import Request

from nextoken.engine.view import EngineView
from nextoken.errors import InvalidRequest, NotFound
from nextoken.inspect import quality
from nextoken.request_options import RequestOptions
from nextoken.sampling_params import SamplingParams
from nextoken.trace.recorder import TraceRecorder

KEEP_TRACES = 4


class InspectState:
    """The inspector's memory: the last traces (id -> `TraceRecorder` and its tokens)."""

    def __init__(self):
        self.traces: LRUCache[str, tuple[TraceRecorder, list[dict]]] = LRUCache(KEEP_TRACES)
        self.ids = itertools.count(1)
        self.last_layer_ms: list[float] | None = None
        self.demo_tasks: set[asyncio.Task] = set()
        self.reference = quality.Reference()  # the float32 reference, built on demand

    def keep(self, tracer: TraceRecorder, tokens: list[dict]) -> str:
        tid = f"t{next(self.ids)}"
        self.traces[tid] = (tracer, tokens)
        self.last_layer_ms = [round(x, 3) for x in tracer.layer_ms]
        return tid

    def get(self, tid: str) -> tuple[TraceRecorder, list[dict]]:
        if tid not in self.traces:
            raise NotFound(f"trace {tid!r} is gone (the last {KEEP_TRACES} are kept); trace again", "trace_id")
        return self.traces[tid]


class InspectContext:
    """What the inspector's routes share: the engine (`get_engine()`: the `AsyncLLMEngine`; it
    raises while loading) and the inspector's memory (`state`)."""

    def __init__(self, get_engine):
        self.get_engine = get_engine
        self.state = InspectState()

    def core(self) -> EngineView:
        """The engine, read through its `EngineView` (public names only)."""
        return self.get_engine().view()

    def whole_model(self):
        """The engine, for views that read the model's weights directly: each rank of a
        tensor-parallel group holds only its shard (and a forward pass needs every rank)."""
        eng = self.core()
        if eng.tensor_parallel is not None:
            raise InvalidRequest("this view reads the whole model, which tensor parallelism splits over processes; "
                                 "run the inspector with --tensor-parallel-size 1", "tensor_parallel_size")
        return eng

    async def between_steps(self, fn):
        return await self.get_engine().between_steps(fn)

    async def run_traced(self, ids: list[int], params: SamplingParams, tracer) -> None:
        async for _ in self.get_engine().generate(ids, params, options=RequestOptions(tracer=tracer)):
            pass

    def encode(self, prompt: str, chat: bool, cap: int | None = None) -> list[int]:
        eng = self.core()
        if chat:
            prompt = eng.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        ids = eng.tokenizer.encode(prompt)
        if not ids:
            raise InvalidRequest("prompt is empty", "prompt")
        if cap is not None and len(ids) > cap:
            raise InvalidRequest(f"prompt has {len(ids)} tokens; traces take at most {cap}", "prompt")
        return ids


def context_of(request: Request) -> InspectContext:
    """The `InspectContext` of the app serving `request` (set by `routes.install`)."""
    return request.app.state.inspector
