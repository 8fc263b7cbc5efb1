"""What generation returns: `RequestOutput` with one `CompletionOutput` per completion.

Shapes follow vLLM's outputs. Times are seconds from `time.perf_counter()`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields


class Logprob(float):
    """A log-probability that reads as vLLM's ``Logprob`` (`logprob`, `rank`, `decoded_token`)
    and is the float itself: `LLM`'s outputs hold these in their logprobs dicts, so a vLLM
    script's ``lp.logprob`` and a float's arithmetic both work. `rank`: 1-based place among the
    position's candidates by probability (None where not known: a chosen token outside the top
    list asked for); `decoded_token`: the token's text (`with_vllm_logprobs`)."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, value: float, rank: int | None = None, decoded_token: str | None = None):
        obj = super().__new__(cls, value)
        obj.rank, obj.decoded_token = rank, decoded_token
        return obj

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


def vllm_step(step: dict[int, float], top: int, text) -> dict[int, Logprob]:
    """One position's ``{token: logprob}`` (the chosen token first, then the `top` most likely,
    as the engine records them) as `Logprob`s; `text`: a token id's text."""
    keys = list(step)
    ranked = keys if len(keys) == top else keys[1:]  # (the chosen token is among the top ones, or before them)
    rank = {t: i + 1 for i, t in enumerate(sorted(ranked, key=lambda t: -step[t]))}
    return {t: Logprob(v, rank.get(t), text(t)) for t, v in step.items()}


def with_vllm_logprobs(out: "RequestOutput", logprobs: int | None, prompt_logprobs: int | None,
                       text) -> "RequestOutput":
    """`out` with its logprobs dicts (of each completion, and of the prompt) as `Logprob`s
    (`vllm_step`; `logprobs`, `prompt_logprobs`: how many alternatives were asked for); in place."""
    for c in out.outputs:
        if c.logprobs is not None:
            c.logprobs = [vllm_step(s, logprobs, text) for s in c.logprobs]
    if out.prompt_logprobs is not None:
        out.prompt_logprobs = [None if s is None else vllm_step(s, prompt_logprobs, text) for s in out.prompt_logprobs]
    return out


@dataclass
class CompletionOutput:
    """One completion of a prompt.

    text: the generated text so far; delta: what was added since the last streamed output;
    token_ids: generated ids; delta_token_ids: the ids added since the last output; finish_reason: None while running, then "stop" (end-of-generation
    token, stop string or stop token) or "length" (max_tokens); stop_reason: the stop string or
    stop token id that ended it, if any; logprobs: per generated position a dict
    ``{token_id: logprob}`` holding the chosen token and the top alternatives (when asked);
    cumulative_logprob: sum of the chosen tokens' logprobs (when asked).
    """

    index: int
    text: str = ""
    delta: str = ""
    token_ids: list[int] = field(default_factory=list)
    delta_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def logprobs_finite(self) -> bool:
        """Whether every log-probability recorded (chosen tokens and alternatives) is finite: a
        model whose logits went NaN or inf fails this."""
        return all(math.isfinite(v) for step in self.logprobs or () for v in step.values())

    @property
    def delta_logprobs(self) -> list[dict[int, float]] | None:
        """The log-probabilities of `delta_token_ids` (None without logprobs or new tokens)."""
        k = len(self.delta_token_ids)
        return None if self.logprobs is None or not k else self.logprobs[-k:]


class Prefix:
    """The first `n` items of an append-only list: what a snapshot of a growing completion holds
    instead of a copy (`CompletionSnapshot`)."""

    __slots__ = ("items", "n")

    def __init__(self, items: list, n: int):
        self.items, self.n = items, n


class _PrefixField:
    """A `CompletionSnapshot` field given as a `Prefix`: copied out of its list on first read, so
    a snapshot costs no copy of the completion so far unless its reader reads it."""

    def __set_name__(self, owner, name):
        self.key = "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        v = obj.__dict__[self.key]
        if type(v) is Prefix:
            v = obj.__dict__[self.key] = v.items[: v.n]
        return v

    def __set__(self, obj, value):
        obj.__dict__[self.key] = value


class CompletionSnapshot(CompletionOutput):
    """A `CompletionOutput` the engine made of a completion still growing: `token_ids` and
    `logprobs` are given as `Prefix` views of the engine's own lists (which it only appends to)
    and copied on first read. A streamed output per request per step then costs no copy of its
    tokens so far (on the tiny model, 256 requests of 1024 tokens: the snapshots took 4.5 ms a
    step, 10.5 with two logprobs, and 1.2-1.6 without the copies); a consumer that reads only
    the deltas (`delta_token_ids`, `delta_logprobs`) never pays it. The engine's lists are read
    on another thread while it appends: a slice under the GIL sees whole appends only."""

    token_ids = _PrefixField()
    logprobs = _PrefixField()

    def __eq__(self, other):  # equal to any CompletionOutput of the same values (dataclasses ask the same class)
        if not isinstance(other, CompletionOutput):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in fields(CompletionOutput))

    __hash__ = None

    @property
    def delta_logprobs(self) -> list[dict[int, float]] | None:
        v, k = self.__dict__["_logprobs"], len(self.delta_token_ids)
        if v is None or not k:
            return None
        return v.items[v.n - k : v.n] if type(v) is Prefix else v[-k:]


@dataclass
class RequestMetrics:
    """Timing of one request, in seconds (perf_counter clock) and token counts."""

    arrival_time: float
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_output_tokens: int = 0
    first_token_time: float | None = None  # when the first output token was sampled
    finished_time: float | None = None
    first_scheduled_time: float | None = None  # when the scheduler first admitted it
    priority: int = 0  # its scheduling priority (`RequestOptions.priority`)

    @property
    def queue_time(self) -> float | None:
        """Arrival to its first admission by the scheduler: the time it waited in the queue."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first sampled token (includes prefill)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (the decode phase), seconds per token."""
        if self.finished_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        t = self.ttft
        return self.num_prompt_tokens / t if t else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        t = self.tpot
        return 1.0 / t if t else None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its completions (streamed or final). `logits`
    (with ``return_logits``): completion 0's raw logits, float32 ``[vocab]``, one per sampled
    token so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    error: str | None = None  # why the request failed, when it did
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """With ``SamplingParams.prompt_logprobs``: per prompt position ``{token_id: logprob}`` (the
    prompt's token and the top alternatives, given the tokens before it); the first is None."""
    logits: list | None = None
    prompt_hidden: object | None = None
    """With ``keep_prompt_hidden``, in the finished output: the final hidden states of the scored
    prompt positions, float ``[n_prompt - 1, hidden]`` (row p scores prompt token p + 1)."""

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the prefix cache served (vLLM's attribute)."""
        return self.metrics.num_cached_tokens if self.metrics else 0

    @property
    def usage(self) -> dict:
        """Token counts as the OpenAI API reports them (plus cached prompt tokens)."""
        m = self.metrics
        return {"prompt_tokens": len(self.prompt_token_ids),
                "cached_tokens": m.num_cached_tokens if m else 0,
                "completion_tokens": sum(len(c.token_ids) for c in self.outputs)}


@dataclass
class EmbeddingOutput:
    """One input's embedding: `embedding`, its vector (floats; unit length for a model that
    normalises)."""

    embedding: list[float]


@dataclass
class ScoringOutput:
    """vLLM's: one pair's score (here the cosine similarity of their embeddings)."""

    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's shape for `LLM.score`'s results: the pair's index as `request_id`, both texts'
    token ids, `outputs`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True


@dataclass
class EmbeddingRequestOutput:
    """vLLM's shape for `LLM.embed`'s results: the input's `request_id` (its index), the
    `prompt_token_ids` it was embedded from, and `outputs`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
