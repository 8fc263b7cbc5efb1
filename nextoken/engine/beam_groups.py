"""Beam searches the engine drives itself (`LLMEngine.add_beam_search`), so that a search keeps
its place under load: after each step, every search whose beams all have their next token is
advanced (`beam.BeamSearch.advance`) and its next step's requests are queued before the next
schedule, as continuations (`RequestOptions.continuation`: ahead of the requests that arrived
after the search), into the sequence slots its last step's requests just freed. A driver outside
the step loop (the server's, before) queued them only after the next step had started, behind
every waiting request: a 64-token beam under a full batch waited for a free slot at every token.

Each step of a search is one engine request per live beam (``<id>/beam<step>.<i>``), as before:
they share their common prefix through the prefix cache. Their outputs never leave the engine;
the search's own id gets one final `RequestOutput` whose completions are its beams, best first
(finish_reason "stop" when a beam ends in an end-of-generation token, else "length"), or its
error (`RequestOutput.error`) when a beam's pass failed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

from nextoken.errors import InvalidRequest
from nextoken.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nextoken.request_options import RequestOptions

log = logging.getLogger("nextoken.engine")


@dataclass
class BeamGroup:
    """One search: its id, its `beam.BeamSearch` (one prompt), how its requests run, and the
    requests of its current step (request id -> index in the step's pending list)."""

    request_id: str
    search: object
    options: RequestOptions
    prompt_ids: list[int]
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    step_requests: dict[str, int] = field(default_factory=dict)
    tops: list = field(default_factory=list)


class BeamGroups:
    """The beam searches of one `LLMEngine`."""

    def __init__(self):
        self.groups: dict[str, BeamGroup] = {}
        self._owner: dict[str, BeamGroup] = {}  # a step request's id -> its search

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups

    def add(self, engine, request_id: str, prompt_ids: list[int], search, options: RequestOptions) -> None:
        """Start `search` (a `beam.BeamSearch` over `prompt_ids` alone) as request `request_id`."""
        group = BeamGroup(request_id, search, options, list(prompt_ids))
        self.groups[request_id] = group
        try:
            self._queue_step(engine, group)
        except BaseException:
            self.abort(engine, request_id)
            raise

    def _queue_step(self, engine, group: BeamGroup) -> None:
        pending = group.search.pending()
        group.step_requests, group.tops = {}, [None] * len(pending)
        opts = dataclasses.replace(group.options, continuation=group.search.step > 0)
        for i, ids in enumerate(pending):
            rid = f"{group.request_id}/beam{group.search.step}.{i}"
            engine.add_request(ids, group.search.params, rid, opts)
            group.step_requests[rid] = i
            self._owner[rid] = group

    @property
    def step_requests(self):
        """The ids of the searches' own requests (a container: `in` asks it)."""
        return self._owner

    def on_outputs(self, engine, outputs: list) -> list:
        """`outputs` of a step without the searches' own requests, plus the final output of each
        search that ended; every search whose step is complete queues its next step. The
        searches' requests' outputs are `RequestOutput`s (`OutputProcessor.collect`'s `plain`);
        any other output (the engine process's wire records) passes through."""
        from nextoken.beam import top_alternatives

        kept = []
        for out in outputs:
            group = self._owner.get(out.request_id) if type(out) is RequestOutput else None
            if group is None:
                kept.append(out)
                continue
            if not out.finished:
                continue
            del self._owner[out.request_id]
            if out.error is not None:
                kept.append(self._end(engine, group, error=out.error))
                continue
            group.tops[group.step_requests.pop(out.request_id)] = top_alternatives(out)[: group.search.params.logprobs]
            if group.first_token_time is None:
                group.first_token_time = time.perf_counter()
            if not group.step_requests:
                try:  # (on the stepping thread: a fault of this search ends it alone, never the loop)
                    group.search.advance(group.tops)
                except Exception as exc:  # noqa: BLE001
                    log.exception("beam search %s failed", group.request_id)
                    kept.append(self._end(engine, group, error=f"beam search failed ({type(exc).__name__}: {exc})"))
                    continue
                if group.search.done:
                    kept.append(self._end(engine, group))
                    continue
                try:  # (on the stepping thread: a refusal ends this search, never the step)
                    self._queue_step(engine, group)
                except InvalidRequest as exc:
                    kept.append(self._end(engine, group, error=str(exc)))
        return kept

    def abort(self, engine, request_id: str) -> None:
        """Stop search `request_id` and its step's requests (no-op for an unknown id)."""
        group = self.groups.pop(request_id, None)
        if group is not None:
            for rid in group.step_requests:
                self._owner.pop(rid, None)
                engine.abort_request(rid)

    def _end(self, engine, group: BeamGroup, error: str | None = None) -> RequestOutput:
        self.abort(engine, group.request_id)  # its other requests of this step, if any
        eog = engine.tokenizer.eog_token_ids
        (result,) = group.search.outputs(engine.tokenizer) if error is None else [None]
        comps = [] if result is None else [
            CompletionOutput(i, text=b.text, token_ids=b.token_ids, cumulative_logprob=b.cumulative_logprob,
                             finish_reason="stop" if b.token_ids and b.token_ids[-1] in eog else "length")
            for i, b in enumerate(result.sequences)]
        metrics = RequestMetrics(group.arrival, len(group.prompt_ids), 0, sum(len(c.token_ids) for c in comps),
                                 group.first_token_time, time.perf_counter(), priority=group.options.priority)
        return RequestOutput(group.request_id, None, group.prompt_ids, comps, True, metrics, error=error)
