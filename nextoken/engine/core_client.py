"""`EngineProcessClient`: the server's `EngineClient` over an engine in a process of its own
(`engine.core`; ``nextoken serve --engine-process``), as vLLM's ``AsyncLLM`` talks to its
``EngineCore``.

The engine process is started with ``spawn`` and builds, warms and steps the engine there; this
side keeps the tokenizer (sent once, for chat templates, prompt checks and grammars), one queue
per request (`async_engine.OutputStreams`: the same `stream` as in one process), and reads the
step messages in the event loop itself (``add_reader`` on the pipe: no thread hop per step).
Messages to the engine go through a sender thread, so a long prompt never holds the event loop
while the engine is in a step. Calls that answer (adding a request, loading an adapter) wait for
the engine's reply, which it makes between two steps, as `AsyncLLMEngine.between_steps` does.

Not over a process: reading the engine's state in place (`view` and `between_steps` raise),
tracing a request (`RequestOptions.tracer`) and tensor parallelism. The inspector, which needs
the first two, runs in the engine process over a `LocalFrontEnd` (`server.app.inspector_host`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import os
import queue
import threading
import uuid

from nextoken.engine.async_engine import OutputStreams
from nextoken.engine.core import CoreInfo, OutputMirror, run_engine_core
from nextoken.engine.stats import SchedulerStats
from nextoken.engine_args import EngineArgs
from nextoken.errors import EngineError, InvalidRequest
from nextoken.request_options import RequestOptions

log = logging.getLogger("nextoken.engine")

NOT_HERE = ("with --engine-process the engine's state is read in its own process (the inspector is served "
            "there), not through a server's client")


def start_engine_core(args: EngineArgs, adapters: list = (), log_level: str = "warning", front_ends: int = 1,
                      inspector=None):
    """Start the engine of `args` in a process of its own (``spawn``; `engine.core.run_engine_core`)
    with `front_ends` pairs of pipes (and `inspector`: the inspector served there, `run_engine_core`'s
    argument). Returns the `multiprocessing.Process` and, per front end,
    ``(to_core, from_core)``: the ends this side (or the process it is handed to) keeps."""
    ctx = multiprocessing.get_context("spawn")  # (a fork would copy the server's threads and PyTorch state)
    ours, theirs = [], []
    for _ in range(front_ends):
        inbox_read, to_core = ctx.Pipe(duplex=False)
        from_core, outbox_write = ctx.Pipe(duplex=False)
        ours.append((to_core, from_core))
        theirs.append((inbox_read, outbox_write))
    process = ctx.Process(target=run_engine_core, name="nextoken-engine", daemon=True,
                          args=(args, list(adapters), log_level, theirs, inspector))
    process.start()
    for inbox_read, outbox_write in theirs:
        inbox_read.close()
        outbox_write.close()
    return process, ours


class EngineProcessClient(OutputStreams):
    """The engine of `args` in a process of its own. Blocks until it is loaded and warm; raises
    what stopped it (`ModelLoadError`, `InvalidRequest`, ...) or `EngineError` when the process
    exits before it is ready. `adapters`: `lora.LoRARequest`s it loads first; `log_level`: its
    logging level. `channel`: ``(to_core, from_core, pid)`` of an engine process another process
    started (`start_engine_core`; ``serve --api-server-count``): this client is one of its front
    ends, and `args` and `adapters` are not used."""

    def __init__(self, args: EngineArgs | None, adapters: list = (), log_level: str = "warning", channel=None,
                 inspector=None):
        super().__init__("" if channel is None else f"{uuid.uuid4().hex[:8]}-")  # (ids unique over the front ends)
        if channel is None:
            if args.tensor_parallel_size > 1:
                raise InvalidRequest("--engine-process does not run tensor parallelism yet; serve without it",
                                     "engine_process")
            self.process, [(self._to_core, self._from_core)] = start_engine_core(args, adapters, log_level,
                                                                                 inspector=inspector)
            self.pid = self.process.pid
        else:
            self.process = None
            self._to_core, self._from_core, self.pid = channel
        try:
            kind, value = self._from_core.recv()
        except (EOFError, OSError):
            raise EngineError(f"the engine process exited while loading{self._exit_code()}") from None
        if kind == "failed":
            self._exit_code()
            raise value
        self._setup(value)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="nextoken-core-outbox", daemon=True)
        self._sender.start()
        # at exit without `close` (a forced exit): the engine process ignores SIGTERM, and
        # multiprocessing would wait for it forever; the pipe closed, it sees the end and exits
        atexit.register(self._to_core.close)

    def _setup(self, info: CoreInfo) -> None:
        self.info = info
        self._mirror = OutputMirror(info.tokenizer)
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._stats = SchedulerStats()
        self._subscribers: list = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._grammars = None

    def _exit_code(self) -> str:
        """Wait a moment for an engine process this client started to end: " (exit code N)", or
        "" for one it did not start."""
        if self.process is None:
            return ""
        self.process.join(5)
        return f" (exit code {self.process.exitcode})"

    # -- requests ---------------------------------------------------------------------------
    async def _add(self, prompt, params, rid: str, options: RequestOptions) -> None:
        if options.tracer is not None:
            raise InvalidRequest("tracing a request needs the engine in the server's process: serve without "
                                 "--engine-process", "trace")
        # (its text made here, so the engine process spends nothing on it; not for an id in use, which the engine refuses)
        here = params is not None and not params.stop and self._mirror.expect(rid, params, options.final_only)
        if here:
            options = dataclasses.replace(options, detokenize=False)
        try:
            await self._call("add_request", prompt, params, rid, options)
        except BaseException:  # (refused, or the engine gone: no record will come for it)
            if here:
                self._mirror.unexpect(rid)
            raise

    async def _add_beam(self, prompt_ids: list[int], search, rid: str, options: RequestOptions) -> None:
        await self._call("add_beam_search", prompt_ids, search, rid, options)

    def abort(self, request_id: str) -> None:
        """Abort a request at the engine's next step boundary (frees its blocks)."""
        self._mirror.forget(request_id)
        self._send(("abort", request_id))

    async def load_lora(self, lora_request) -> int:
        """`LLMEngine.load_lora` in the engine process: the adapter's id."""
        return await self._call("load_lora", lora_request)

    async def unload_lora(self, lora_id: int) -> None:
        """`LLMEngine.unload_lora` in the engine process."""
        await self._call("unload_lora", lora_id)

    async def _call(self, name: str, *args):
        """`LLMEngine.<name>(*args)` in the engine process, between two of its steps: its value, or
        the exception it raised. Cancelled while an add waits: the request is aborted."""
        if self.dead is not None:
            raise EngineError(f"the engine loop has stopped: {self.dead!r}")
        self.attach()
        call_id = next(self._call_ids)
        future = self._calls[call_id] = self._loop.create_future()
        self._send(("call", call_id, name, args))
        try:
            return await future
        except asyncio.CancelledError:
            if name in ("add_request", "add_beam_search"):
                self.abort(args[2])
            raise
        finally:
            self._calls.pop(call_id, None)

    # -- the model, checks before a request is queued, observation --------------------------
    @property
    def tokenizer(self):
        return self.info.tokenizer

    @property
    def config(self):
        """The model's `ModelConfig`."""
        return self.info.config

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def watermark(self):
        return self.info.watermark

    @property
    def model_path(self):
        return self.info.model_path

    @property
    def kv_capacity(self) -> int:
        return self.info.kv_capacity

    @property
    def sampling_defaults(self) -> dict:
        return self.info.sampling_defaults

    @property
    def max_logprobs(self) -> int:
        return self.info.max_logprobs

    @property
    def num_waiting(self) -> int:
        """Waiting sequences at the engine's last step."""
        return self._stats.waiting

    def compile_grammar(self, structured) -> None:
        """Compile a request's grammar here (the check; the engine process compiles and caches its
        own); blocking. Raises `InvalidRequest`."""
        from nextoken.structured.backend import GrammarCompiler

        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size)
        self._grammars.compile(structured)

    def encode_prompt(self, prompt, params, truncate: bool = False) -> list[int]:
        """`engine.validation.encode_prompt` with the engine's tokenizer and limits."""
        from nextoken.engine.validation import encode_prompt

        return encode_prompt(self.tokenizer, self.config.vocab_size, self.max_model_len, prompt, params, truncate)

    def scheduler_stats(self) -> SchedulerStats:
        """The engine's `SchedulerStats` as of its last step (or its last message between steps)."""
        return self._stats

    def subscribe(self, subscriber) -> None:
        """`subscriber(StepStats)` for each of the engine's steps, on the event loop (its
        `finished` is empty: the requests' engine objects stay in the engine process)."""
        self._subscribers.append(subscriber)

    def view(self):
        raise EngineError(NOT_HERE)

    async def between_steps(self, fn):
        raise EngineError(NOT_HERE)

    @property
    def is_running(self) -> bool:
        """Whether the engine process runs: False once it has exited, even before its pipe says
        so. Asked on the event loop (``/health``), it starts reading the pipe there, so an engine
        process that dies before any request is noticed (the server then exits)."""
        with contextlib.suppress(RuntimeError):  # (no running loop: only the liveness is checked)
            asyncio.get_running_loop()
            self.attach()
        return self.dead is None and self._alive()

    def _alive(self) -> bool:
        if self.process is not None:
            return self.process.is_alive()
        try:
            os.kill(self.pid, 0)
            return True
        except OSError:  # (gone, or its id taken by a process not ours)
            return False

    # -- the pipes --------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        self._outbox.put(message)

    def _send_loop(self) -> None:
        while True:
            message = self._outbox.get()
            if message is None:
                return
            try:
                self._to_core.send(message)
            except (OSError, ValueError):  # the engine process is gone: the reader says so
                return

    def attach(self) -> None:
        """Read the engine's messages in the running event loop from now on (the first call; later
        ones do nothing). A server calls it as its loop starts (`server.serve`): with several server
        processes the engine process sends each one every step's counts, requests or not, and a
        pipe nobody reads fills until the engine process waits on it, stopping every request.
        Sending a request attaches too."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            fd = self._from_core.fileno()
            self._loop.add_reader(fd, self._on_readable)
            # `recv` reads a whole message and needs a blocking pipe: uvloop's add_reader (libuv's
            # poll) makes it non-blocking, and a message larger than the pipe's buffer then ended
            # in EAGAIN halfway, taken for the engine process's end
            os.set_blocking(fd, True)

    def _on_readable(self) -> None:
        try:  # one message a call: the streams its outputs woke run before the next step's
            message = self._from_core.recv()
        except (EOFError, OSError) as exc:  # the pipe ended (or broke: said, for it is not the usual end)
            self._loop.remove_reader(self._from_core.fileno())
            if not self._closing:
                how = "" if isinstance(exc, EOFError) else f" (its pipe: {type(exc).__name__}: {exc})"
                self._gone(EngineError(f"the engine process exited{self._exit_code()}{how}"))
            return
        try:
            self._dispatch(message)
        except Exception:  # noqa: BLE001 - a fault in handling one message (a subscriber's, a stream's)
            log.exception("the engine's %r message could not be handled", message[0])  # is not the engine's end

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "step":
            _, records, steps, self._stats = message
            mirror, queues = self._mirror, self._queues
            outputs = []
            for record in records:
                if record[0] in queues:  # (a request nobody streams any more was aborted: dropped)
                    out = mirror.decode(record)
                    if out is not None:
                        outputs.append(out)
            self._deliver(outputs)
            for stats in steps:
                for subscriber in self._subscribers:
                    subscriber(stats)
        elif kind == "reply":
            _, call_id, value, error = message
            future = self._calls.get(call_id)
            if future is not None and not future.done():
                future.set_exception(error) if error is not None else future.set_result(value)
        elif kind == "stats":
            self._stats = message[1]
        elif kind == "dead":
            self._gone(message[1])

    def _gone(self, exc: BaseException) -> None:
        """The engine process stopped: waiting calls and streams raise, `on_dead` is told."""
        if self.dead is not None:
            return
        log.error("the engine process stopped: %s", exc)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineError(f"the engine loop has stopped: {exc!r}"))
        self._stop(exc)

    def close(self) -> None:
        """Stop the engine process (it writes the disk tier's queued blocks first) and wait for it;
        for a front end of an engine process another process started, say this one is done."""
        self._closing = True
        self._send(("close",))
        self._outbox.put(None)
        if self.process is None:
            self._sender.join(5)
            return
        self.process.join(60)
        if self.process.is_alive():
            log.warning("the engine process did not stop within 60 s; killing it")
            self.process.kill()
            self.process.join(5)


class LocalFrontEnd(EngineProcessClient):
    """A front end inside the engine process itself: the inspector's (`server.app.inspector_host`), whose views
    read the engine and the model in place. Its messages go straight into the core's inbox as
    front end `k` (`engine.core.EngineCore`'s local one), the core's messages come back as calls
    on its event loop (`outbox`), nothing pickled; `view` reads the engine, `between_steps` runs a
    function between two steps, and a traced request runs (its recorder in this process)."""

    def __init__(self, engine, info: CoreInfo, inbox: queue.SimpleQueue, k: int):
        OutputStreams.__init__(self, "inspector-")
        self.engine, self._inbox, self._k = engine, inbox, k
        self.process, self.pid = None, os.getpid()
        self._setup(info)
        self.outbox = _LocalOutbox(self)

    async def _add(self, prompt, params, rid: str, options: RequestOptions) -> None:
        await self._call("add_request", prompt, params, rid, options)

    def _send(self, message: tuple) -> None:
        self._inbox.put((self._k, message))

    def attach(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()

    def view(self):
        from nextoken.engine.view import EngineView

        return EngineView(self.engine)

    async def between_steps(self, fn):
        """`fn()` run by the engine's loop between two steps: its value (or what it raised)."""
        from nextoken.engine.core import BETWEEN_STEPS

        return await self._call(BETWEEN_STEPS, fn)

    @property
    def is_running(self) -> bool:
        return self.dead is None

    def close(self) -> None:
        self._closing = True


class _LocalOutbox:
    """What the core sends to a `LocalFrontEnd`: each message handed to its event loop (before
    its first request, only the counts are kept)."""

    def __init__(self, client: LocalFrontEnd):
        self.client = client

    def send(self, message: tuple) -> None:
        loop = self.client._loop
        if loop is None:
            if message[0] in ("stats", "step"):
                self.client._stats = message[-1]
            return
        loop.call_soon_threadsafe(self.client._dispatch, message)
