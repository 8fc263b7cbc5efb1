"""The engine in a process of its own (vLLM's EngineCore), and what passes between it and the
server's process (`core_client.EngineProcessClient`).

    server process(es)                               engine process (`run_engine_core`)
    add_request / abort / load_lora ... --pipe-->    a reader thread per front end -> inbox
                                                     loop: messages between steps, `LLMEngine.step`
    event loop reads step messages     <--pipe--     ("step", output records, StepStats, SchedulerStats)

With ``serve --api-server-count N`` the engine process has N front ends, a pair of pipes each:
a request's outputs go to the one that added it.

In one process the server's work (rendering and writing each streamed chunk, about 30-60 us of
Python a chunk) and the engine's host work per step (scheduling, inputs, detokenizing, stop checks)
share one GIL; in two they run at once, on two cores. Messages are tuples on two one-way
`multiprocessing` pipes (pickled by it) that the server creates for the process it starts: no
one else writes to them. A step's outputs travel as deltas: a completion's new text, token ids
and log-probabilities, never what was sent before, made from the requests' state as the step
collects them (`OutputWire.encode_group`: no `RequestOutput` in between, 2-3 us a row less of
the engine's 25-28 at 256 streams; a decode's usual record just its request id and new token
ids, `OutputWire.tokens_only`) or from a `RequestOutput` (`OutputWire.encode`: a beam
search's). The server's side keeps each request's lists and rebuilds the `RequestOutput` the
engine would have made (`OutputMirror.decode`), with `Prefix` views of its lists as the engine's
snapshots have.

The engine process ignores SIGINT and SIGTERM (a terminal's Ctrl-C and a service manager reach
every process of the group): the server drains its requests and then closes it (``("close",)``).
It exits when its pipe from the server closes (the server died).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import signal
import threading
from dataclasses import dataclass

from nextoken.engine_args import EngineArgs
from nextoken.errors import EngineError, NextokenError
from nextoken.outputs import CompletionOutput, CompletionSnapshot, Prefix, RequestMetrics, RequestOutput
from nextoken.tokenizer.detokenizer import FinalText, IncrementalDetokenizer

log = logging.getLogger("nextoken.engine")

NUM_OUTPUT = [f.name for f in dataclasses.fields(RequestMetrics)].index("num_output_tokens")  # (in a record's metrics)
# the engine methods the server's process may call, by name (`("call", id, name, args)`)
CALLS = ("add_request", "add_beam_search", "load_lora", "unload_lora")
BETWEEN_STEPS = "between_steps"  # the local front end's: run its function between two steps


@dataclass
class CoreInfo:
    """What the server's process needs of the engine, sent once when it is ready: the tokenizer
    (pickled whole, chat template included), the model's `ModelConfig`, `max_model_len`, the
    `WatermarkConfig`, the model's path, the tokens the KV cache holds, the model's sampling
    defaults and the most log-probabilities a request may ask for."""

    tokenizer: object
    config: object
    max_model_len: int
    watermark: object
    model_path: str
    kv_capacity: int
    sampling_defaults: dict
    max_logprobs: int


class OutputWire:
    """The engine's side of the output deltas: `encode` turns a `RequestOutput` into a record
    holding what is new since the request's last record."""

    def __init__(self):
        self._sent: dict[str, int] = {}  # requests whose head went out -> their cached prompt tokens as last sent

    def encode(self, out: RequestOutput) -> tuple:
        """``(request_id, head, finished, error, metrics, completions, extra)``: `head` is
        ``(prompt, prompt_token_ids)`` on a request's first record, else None; `metrics` the
        `RequestMetrics` fields in order; each completion is ``(index, delta, delta_token_ids,
        delta_logprobs, cumulative_logprob, finish_reason, stop_reason)`` for a snapshot (its
        lists grow by the deltas) or the `CompletionOutput` itself (a beam search's final beams);
        `extra` is None or ``(prompt_logprobs, logits, prompt_hidden)`` when the request has them."""
        rid = out.request_id
        head = None
        if rid not in self._sent:
            head = (out.prompt, out.prompt_token_ids)
            self._sent[rid] = -1  # (no `tokens_only` record for these: their outputs are made already)
        if out.finished:
            self._sent.pop(rid, None)
        comps = [(c.index, c.delta, c.delta_token_ids, c.delta_logprobs, c.cumulative_logprob, c.finish_reason,
                  c.stop_reason) if type(c) is CompletionSnapshot else c for c in out.outputs]
        extra = None
        if out.prompt_logprobs is not None or out.logits is not None or out.prompt_hidden is not None:
            extra = (out.prompt_logprobs, out.logits, out.prompt_hidden)
        m = out.metrics
        return (rid, head, out.finished, out.error, None if m is None else tuple(vars(m).values()), comps, extra)

    def encode_group(self, group, finished: bool) -> tuple:
        """The record `encode` makes of `output_processor.make_output(group, finished)`, made
        from the group itself (its side effects the same: metrics counted, deltas restarted):
        no snapshot objects for a record to read them back from (`LLMEngine.step`'s `make`; the
        tests hold the two equal). A decode's usual record, new token ids alone, is the two-field
        ``(request_id, delta_token_ids)`` (`tokens_only`)."""
        from nextoken.engine.output_processor import count_output, output_made

        rid = group.request_id
        short = self.tokens_only(group, finished)
        if short is not None:
            return short
        head = None
        if rid not in self._sent:
            head = (group.prompt, group.prompt_ids)
        self._sent[rid] = group.seqs[0].num_cached_tokens
        if finished:
            del self._sent[rid]
        m = count_output(group)
        comps = [(c.index, c.delta, c.delta_token_ids,
                  c.logprobs[len(c.logprobs) - len(c.delta_token_ids):] if c.logprobs is not None and c.delta_token_ids
                  else None, c.cumulative_logprob, c.finish_reason, c.stop_reason) for c in group.completions]
        output_made(group)
        extra = None
        hidden = group.prompt_hidden if finished else None
        if group.prompt_logprobs is not None or group.logits is not None or hidden is not None:
            extra = (None if group.prompt_logprobs is None else list(group.prompt_logprobs),
                     None if group.logits is None else list(group.logits), hidden)
        return (rid, head, finished, group.error, tuple(vars(m).values()), comps, extra)

    def tokens_only(self, group, finished: bool) -> tuple | None:
        """``(request_id, delta_token_ids)`` for a record that would say nothing else the other
        side cannot tell (`OutputMirror.decode` rebuilds the rest): after the request's first
        record, unfinished, one completion with no log-probabilities and no text from the engine
        (its front end makes the text, or none was released), nothing extra, the cached prompt
        tokens as last sent (its metrics then differ from the last record's in the output count
        alone). Its side effects are `encode_group`'s. None for any other."""
        c = group.completions[0]
        if finished or c.delta or c.logprobs is not None or len(group.completions) != 1 or group.error is not None \
                or self._sent.get(group.request_id) != group.seqs[0].num_cached_tokens \
                or group.prompt_logprobs is not None or group.logits is not None:
            return None
        ids = c.delta_token_ids
        group.metrics.num_output_tokens = group.output_tokens = len(c.token_ids)  # (`count_output`'s, for one
        c.delta_token_ids = []  # completion whose cached count is as sent; `output_made`'s)
        group.changed = False
        return group.request_id, ids

    def forget(self, request_id: str) -> None:
        """`request_id` was aborted: a later request of that id starts afresh."""
        self._sent.pop(request_id, None)


class OutputMirror:
    """The server's side of the output deltas: each request's prompt and its completions' text,
    token ids and log-probabilities so far; `decode` rebuilds the engine's `RequestOutput`. For
    a request `expect` named (sent with ``RequestOptions.detokenize`` False), it makes the text
    itself from the token ids, with `tokenizer`: an `IncrementalDetokenizer` per completion (a
    `FinalText` for a final-only request), as the engine would have (vLLM's front ends
    detokenize so too)."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self._requests: dict[str, list] = {}  # id -> [prompt, prompt ids, {index: [text, ids, logprobs, detok]}, params, metrics]
        self._expected: dict[str, tuple] = {}  # id -> (its SamplingParams, final_only), until its first record

    def expect(self, request_id: str, params, final_only: bool = False) -> bool:
        """Request `request_id` (`params`: its `SamplingParams`) comes without text: make it here
        (`final_only`: in one decode at its end, as the engine would, `FinalText`). False, and
        nothing noted, for an id this side knows already (the engine refuses it)."""
        if request_id in self._expected or request_id in self._requests:
            return False
        self._expected[request_id] = (params, final_only)
        return True

    def unexpect(self, request_id: str) -> None:
        """The engine refused the request `expect` noted: no record will come for it."""
        self._expected.pop(request_id, None)

    def decode(self, record: tuple) -> RequestOutput | None:
        """The `RequestOutput` a record (`OutputWire.encode`, or its two-field
        `OutputWire.tokens_only`) stands for; None for a request this side has forgotten (aborted
        here while the engine's record was on its way)."""
        if len(record) == 2:
            return self._tokens(*record)
        rid, head, finished, error, metrics, comps, extra = record
        if head is not None:
            self._requests[rid] = [head[0], head[1], {}, self._expected.pop(rid, None), None]
        elif rid not in self._requests:
            return None
        entry = self._requests[rid]
        entry[4] = None if metrics is None else list(metrics)  # (`_tokens` updates its output count)
        prompt, prompt_ids, kept, params, _ = entry
        outs = []
        for c in comps:
            if isinstance(c, CompletionOutput):
                outs.append(c)
                continue
            index, delta, delta_ids, delta_logprobs, cumulative, finish, stop = c
            state = kept.get(index)
            if state is None:
                state = kept[index] = ["", [], None if delta_logprobs is None and cumulative is None else [],
                                       None if params is None else self._detokenizer(*params)]
            if state[3] is not None:  # (the engine sent ids alone: the text, as its detokenizer would make it)
                # (such a request has no stop strings: a "stop" is its last token, an end-of-generation or
                # stop token id, whose text the engine never adds (`process_token`), as vLLM's detokenizer)
                text_ids = delta_ids[:-1] if finish == "stop" else delta_ids
                delta = self._text(state[3], text_ids, finish)
            state[0] += delta
            state[1].extend(delta_ids)
            if delta_logprobs:
                state[2].extend(delta_logprobs)
            ids, lps = state[1], state[2]
            outs.append(CompletionSnapshot(index, state[0], delta, Prefix(ids, len(ids)), delta_ids, finish, stop,
                                           None if lps is None else Prefix(lps, len(lps)), cumulative))
        if finished:
            del self._requests[rid]
        prompt_logprobs, logits, hidden = extra if extra is not None else (None, None, None)
        return RequestOutput(rid, prompt, prompt_ids, outs, finished,
                             None if metrics is None else RequestMetrics(*metrics), error, prompt_logprobs, logits,
                             hidden)

    def _tokens(self, rid: str, delta_ids: list[int]) -> RequestOutput | None:
        """A `tokens_only` record's output: completion 0 grows by `delta_ids` (its text made here
        for a request `expect` noted, else none new), the last record's metrics with the output
        count brought up to date."""
        entry = self._requests.get(rid)
        if entry is None:
            return None
        prompt, prompt_ids, kept, _, metrics = entry
        state = kept[0]
        delta = self._text(state[3], delta_ids, None) if state[3] is not None else ""
        state[0] += delta
        ids = state[1]
        ids.extend(delta_ids)
        metrics[NUM_OUTPUT] = len(ids)
        out = CompletionSnapshot(0, state[0], delta, Prefix(ids, len(ids)), delta_ids, None, None, None, None)
        return RequestOutput(rid, prompt, prompt_ids, [out], False, RequestMetrics(*metrics), None, None, None, None)

    def _detokenizer(self, params, final_only: bool):
        """A completion's detokenizer, the one the engine would have given it (`new_group`)."""
        if final_only:
            return FinalText(self.tokenizer, params.skip_special_tokens)
        return IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)

    @staticmethod
    def _text(detok, delta_ids: list[int], finish: str | None) -> str:
        """The text `delta_ids` release (`output_processor.process_token`'s detokenizer calls: each
        token added, the pending bytes flushed when a token ended the completion; an aborted or
        failed one keeps them back, as the engine's detokenizer does, `finish_sequence`)."""
        for t in delta_ids:
            detok.add_token(t)
        if finish in ("stop", "length"):
            detok.flush()
            return detok.emit(True)
        if finish is not None and type(detok) is FinalText:
            return detok.so_far()
        return detok.emit(False)

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._expected.pop(request_id, None)


def sendable(exc: BaseException) -> BaseException:
    """`exc` as the server's process receives it: one of our errors as it is (each is rebuilt
    from its message, `InvalidRequest` with its field too), anything else as an `EngineError`
    naming its type and message."""
    return exc if isinstance(exc, NextokenError) else EngineError(f"{type(exc).__name__}: {exc}")


def run_engine_core(args: EngineArgs, adapters: list, log_level: str, channels: list, inspector=None) -> None:
    """The engine process's main: build and warm the engine (`adapters`: `lora.LoRARequest`s to
    load first), say ``("ready", CoreInfo)`` (or ``("failed", exception)``) to every front end,
    then serve their messages between steps until each has said ``("close",)`` or closed its
    pipe. `channels`: one ``(inbox, outbox)`` pair of pipe ends per front end (``serve
    --api-server-count N``: N). `inspector`: ``(start, ServerArgs, path)``: serve the inspector here
    too, on the Unix socket `path`, over a front end of this process that ``start(engine, info,
    inbox, k, ServerArgs, path)`` returns (`server.app.inspector_host.serve_inspector`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from nextoken.engine.engine import LLMEngine
    from nextoken.engine.launch import freeze_heap, warm_up

    outboxes = [out for _, out in channels]
    try:
        engine = LLMEngine.from_engine_args(args)
        for lora in adapters:
            engine.runner.loras.add(lora)
        warm_up(engine)
        freeze_heap()
    except BaseException as exc:  # noqa: BLE001 - whatever stops the start, the server says it
        for out in outboxes:
            _send_quietly(out, ("failed", sendable(exc)))
        return
    kv = engine.kv
    info = CoreInfo(engine.tokenizer, engine.config, engine.max_model_len, engine.watermark, str(engine.model_path),
                    kv.pool.num_blocks * kv.block_size, engine.sampling_defaults, engine.max_logprobs)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    local = None
    if inspector is not None:  # (listening before the servers hear "ready")
        start, server_args, path = inspector
        local = start(engine, info, inbox, len(channels), server_args, path)
    for out in outboxes:
        _send_quietly(out, ("ready", info))
    for k, (conn, _) in enumerate(channels):
        threading.Thread(target=_read, args=(conn, inbox, k), name=f"nextoken-core-inbox-{k}", daemon=True).start()
    try:
        EngineCore(engine, outboxes, local).run(inbox)
    finally:
        engine.close()


class Sender:
    """The core's messages to its front ends, each front end's sent in order by a thread of its
    own (vLLM's engine core sends from a thread too): a step never waits on a pipe, so a server
    process whose event loop is busy or stalled holds up only its own streams, not the other
    processes' (with the step waiting on its full pipe, it held them all), and the pickling
    overlaps the next step. Each front end's messages keep the order the core sent them in (a
    call's reply before the step records of the request it added). A front end whose pipe has
    gone is reported to the core as its close, ``(k, None)`` in the `inbox`, and sent nothing
    more."""

    def __init__(self, outs: list, inbox: queue.SimpleQueue):
        self.inbox = inbox
        self.queues = [queue.SimpleQueue() for _ in outs]
        self.threads = [threading.Thread(target=self._run, args=(k, out, q), name=f"nextoken-core-outbox-{k}",
                                         daemon=True) for k, (out, q) in enumerate(zip(outs, self.queues))]
        for t in self.threads:
            t.start()

    def send(self, k: int, message: tuple) -> None:
        self.queues[k].put(message)

    def _run(self, k: int, out, q: queue.SimpleQueue) -> None:
        while (message := q.get()) is not None:
            if not _send_quietly(out, message):
                self.inbox.put((k, None))
                return

    def close(self, timeout: float = 30.0) -> None:
        """Return once every message queued before has been sent, or its front end is gone (at
        most `timeout` seconds a front end: one that stopped reading is not waited on forever)."""
        for q in self.queues:
            q.put(None)
        for t in self.threads:
            t.join(timeout)


def _send_quietly(conn, message) -> bool:
    """Send `message` on `conn`; False when that front end is gone (its pipe closed)."""
    try:
        conn.send(message)
        return True
    except (OSError, ValueError, RuntimeError):  # (RuntimeError: the inspector's event loop has closed)
        return False


def _read(conn, inbox: queue.SimpleQueue, k: int) -> None:
    """Front end `k`'s messages into `inbox` as ``(k, message)`` (so its writes never wait for a
    step); ``(k, None)`` when its pipe closes."""
    try:
        while True:
            inbox.put((k, conn.recv()))
    except (EOFError, OSError):
        inbox.put((k, None))


class EngineCore:
    """The engine process's loop: the front ends' messages between steps, a step while any
    request is unfinished, each step's outputs, `StepStats` and `SchedulerStats` sent back (by
    its `Sender`'s thread).

    Each request's outputs go to the front end that added it (`owner`); the `SchedulerStats` go
    to every front end, each step's `StepStats` to one (the first still open: with several, the
    server's metrics, summed over its processes, count each step once). `local`: a front end in
    this process (the inspector's, `core_client.LocalFrontEnd`), after the pipes' ones: it may
    run a function between two steps (``between_steps``), and the loop ends when the pipes' front
    ends have all closed, whatever it does."""

    def __init__(self, engine, outboxes: list, local=None):
        self.engine, self.outs = engine, list(outboxes)
        self.open = set(range(len(self.outs)))  # the pipes' front ends still open
        self.local = None
        if local is not None:
            self.local = len(self.outs)
            self.outs.append(local.outbox)
        self.owner: dict[str, int] = {}  # request id -> the front end that added it
        self.wire = OutputWire()
        self.steps: list = []
        self.sender: Sender | None = None
        engine.subscribe(self.steps.append)

    def run(self, inbox: queue.SimpleQueue) -> None:
        """Serve the front ends' messages in `inbox` (``(k, message)``; ``(k, None)``: its pipe
        closed) and step, until every pipe front end has closed; every message sent before it
        returns."""
        self.sender = Sender(self.outs, inbox)
        try:
            self._loop(inbox)
        finally:
            self.sender.close()

    def _loop(self, inbox: queue.SimpleQueue) -> None:
        engine = self.engine
        while self.open:
            busy = engine.has_unfinished_requests()
            messages = [] if busy else [inbox.get()]  # idle: wait for the next message
            while True:
                try:
                    messages.append(inbox.get_nowait())
                except queue.Empty:
                    break
            for k, m in messages:
                if m is None or m[0] == "close":
                    self.close(k)
                elif k in self.open or k == self.local:  # (nothing is taken from a front end after its close)
                    self.handle(k, m)
            if not self.open:
                return
            if not engine.has_unfinished_requests():
                if messages:  # (aborts and adds that changed the counts without a step)
                    self.stats()
                continue
            try:
                outputs = engine.step(make=self.wire.encode_group)
            except Exception as exc:  # the engine is broken: the servers' requests fail, it exits
                log.exception("the engine's step failed")
                for k in self.targets():
                    self.sender.send(k, ("dead", sendable(exc)))
                return
            if not outputs and not self.steps:  # a step that did nothing: only the counts, once idle
                if not engine.has_unfinished_requests():
                    self.stats()
                continue
            self.send_step(outputs)

    def send_step(self, outputs: list) -> None:
        """A step's outputs (records, or `RequestOutput`s: a beam search's), each to its front end,
        with the step's stats."""
        from nextoken.engine.stats import SchedulerStats

        stats = SchedulerStats.now(self.engine)
        steps = [dataclasses.replace(s, finished=[]) for s in self.steps]  # (engine objects stay here)
        self.steps.clear()
        outputs = [o if type(o) is tuple else self.wire.encode(o) for o in outputs]
        if len(self.outs) == 1:  # (one front end, whose requests they all are)
            self._send(0, ("step", outputs, steps, stats))
            return
        records: dict[int, list] = {k: [] for k in self.targets()}
        for o in outputs:
            k = self.owner.pop(o[0], 0) if len(o) > 2 and o[2] else self.owner.get(o[0], 0)  # (finished: forgotten)
            if k in records:
                records[k].append(o)
        first = min(self.open, default=None)
        for k, rs in records.items():
            self._send(k, ("step", rs, steps if k == first else [], stats))

    def stats(self) -> None:
        from nextoken.engine.stats import SchedulerStats

        stats = SchedulerStats.now(self.engine)
        for k in self.targets():
            self._send(k, ("stats", stats))

    def targets(self) -> list[int]:
        """The front ends that get messages: the open ones and the local one."""
        return sorted(self.open) + ([] if self.local is None else [self.local])

    def _send(self, k: int, message: tuple) -> None:
        self.sender.send(k, message)

    def close(self, k: int) -> None:
        """Front end `k` is done (it said so, or its pipe closed): its requests are aborted."""
        if k not in self.open:
            return
        self.open.discard(k)
        for rid in [rid for rid, owner in self.owner.items() if owner == k]:
            self.engine.abort_request(rid)
            self.wire.forget(rid)
            del self.owner[rid]

    def handle(self, k: int, m: tuple) -> None:
        """Front end `k`'s message: ``("abort", request_id)`` or ``("call", call id, method,
        args)`` (one of `CALLS`), answered ``("reply", call id, value, exception)``."""
        if m[0] == "abort":
            self.engine.abort_request(m[1])
            self.wire.forget(m[1])
            self.owner.pop(m[1], None)
            return
        _, call_id, name, args = m
        value, error = None, None
        try:
            if name == BETWEEN_STEPS and k == self.local:  # (a function of this process: the inspector's)
                value = args[0]()
            elif name not in CALLS:
                raise EngineError(f"the engine process has no call {name!r}")
            else:
                value = getattr(self.engine, name)(*args)
            if name in ("add_request", "add_beam_search") and len(self.outs) > 1:
                self.owner[value] = k
        except Exception as exc:  # noqa: BLE001 - the caller gets it, as in one process
            error = sendable(exc)
        self._send(k, ("reply", call_id, value, error))
