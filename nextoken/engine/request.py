"""A request's state inside the engine.

The one invariant the scheduler works from (see docs/design.md): ``num_computed_tokens`` of the
request's ``num_tokens`` (prompt + output so far) have their keys and values in the KV cache.
Each step the scheduler hands out new tokens so that computed catches up with total: a prompt
is prefilled in one or more chunks, a decode is the case of one new token, a prefix-cache hit
starts computed at the cached length, and preemption sends it back to 0.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from nextoken.sample.rng import DrawGenerator
from nextoken.sample.sampler import SamplerRequest, make_generator
from nextoken.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# the members as module constants, for the checks made per sequence and step: read from the enum class,
# a member costs 0.3 us (its descriptor), from here 0.1
RUNNING, FINISHED = RequestStatus.RUNNING, RequestStatus.FINISHED


@dataclass(eq=False)
class Request:
    """One sequence to generate (a completion; `n > 1` makes one per completion).

    request_id: unique id of this sequence; group_id: the id of the user's request it belongs
    to; index: which completion of that request it is.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: DrawGenerator  # this sequence's draws (`sample.rng`)
    group_id: str = ""
    index: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    parent: "Request | None" = None  # for completions 1..n-1: share this one's prompt blocks
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache on admission
    num_preemptions: int = 0
    all_token_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    disk_keys: list[bytes] = field(default_factory=list)  # the disk tier's chain keys of its full blocks
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    admitted: bool = False
    sampler_row: SamplerRequest | None = None  # what the sampler needs, made once
    spec_k: int = 0  # speculative decoding: tokens to draft next step (0: the configured number)
    spec_skip: int = 0  # steps left without drafting (after a verification that accepted nothing)
    spec_backoff: int = 0  # how many steps the next such pause lasts
    tracer: object | None = None  # `nextoken.trace` recorder: this request runs in a pass of its own
    first_tokens: list[int] = field(default_factory=list)  # emitted in place of the next draws (the quick start's)
    lora_id: int = 0  # its LoRA adapter (`lora.LoRAManager`), 0 for the base model
    cache_salt: str | None = None  # vLLM's: only requests of the same salt share prefix-cache blocks
    priority: int = 0  # lower goes first under the priority policy (`engine.request_queue`)
    client: str = ""  # who sent it: the fair policy's unit of service
    continuation: bool = False  # continues a request that held a place (a beam step): keeps it
    queue_seq: int = 0  # its place in the waiting queue (`WaitingQueue`)
    queued_time: float = 0.0  # when it last joined the waiting queue (perf_counter)
    first_scheduled_time: float | None = None  # when it was first admitted: its queue time ends
    rank: int = 0  # its effective priority when last admitted (`Scheduler._run`)
    num_pending: int = 0  # async scheduling: tokens sampled on the device, not yet appended (0-2)
    fed_row: int = -1  # ... the last one's row in the draw of the step in flight (`LLMEngine._launch`)

    def __post_init__(self):
        self.all_token_ids = list(self.prompt_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far (those in flight not counted: `num_pending`)."""
        return len(self.all_token_ids)

    def ends_in_flight(self, max_model_len: int | None) -> bool:
        """Whether a token in flight (async scheduling) is its last by length (`max_tokens`, or
        `max_model_len` tokens in all, when given): nothing more to schedule for it."""
        return self.num_pending > 0 and (
            len(self.output_ids) + self.num_pending >= self.params.max_tokens
            or (max_model_len is not None and self.num_tokens + self.num_pending >= max_model_len))

    @property
    def finished(self) -> bool:
        return self.status is FINISHED

    def append_output(self, token: int) -> None:
        self.output_ids.append(token)
        self.all_token_ids.append(token)


def completion_seed(seed: int | None, index: int) -> int | None:
    """The seed of completion `index` of a request seeded with `seed` (completion 0 uses `seed`)."""
    if seed is None or index == 0:
        return seed
    return (seed * 0x9E3779B97F4A7C15 + index) & 0xFFFF_FFFF_FFFF_FFFF


def make_sequences(request_id: str, prompt_ids: list[int], params: SamplingParams, grammars: list,
                   tracer=None, first_tokens: tuple[tuple[int, ...], int] | None = None,
                   lora_id: int = 0, priority: int = 0, client: str = "",
                   continuation: bool = False) -> list[Request]:
    """The `params.n` sequences of a request: ``<id>#<i>``, each with its own generator
    (`completion_seed`), grammar (`grammars[i]`, or None) and sampler row; the later ones fork
    from the first (`parent`), which computes the shared prompt. `first_tokens`: ``(tokens,
    draws)``, the first sequence's first tokens drawn already and the numbers of its seeded
    stream they used. `lora_id`: their adapter; `priority`, `client`, `continuation`: how the
    scheduler orders them (`engine.request_queue`)."""
    seqs: list[Request] = []
    for i in range(params.n):
        s = Request(f"{request_id}#{i}", prompt_ids, params, make_generator(completion_seed(params.seed, i)),
                    group_id=request_id, index=i, parent=seqs[0] if i else None)
        if i == 0 and first_tokens is not None:
            s.first_tokens = list(first_tokens[0])
            s.generator.skip(first_tokens[1])
        s.sampler_row = SamplerRequest(params, s.prompt_ids, s.output_ids, s.generator, grammars[i])
        s.tracer, s.lora_id = tracer, lora_id
        s.priority, s.client, s.continuation = priority, client, continuation
        seqs.append(s)
    return seqs
