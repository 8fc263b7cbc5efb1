"""SamplingParams: how one request turns logits into tokens, and when it stops.

Names and meanings follow the OpenAI API and vLLM's ``SamplingParams``. `validate()` raises
`InvalidRequest` naming the field and the allowed range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nextoken.errors import InvalidRequest
from nextoken.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20  # the most logprobs a request may ask for, unless the engine says otherwise (max_logprobs)
# the mark of a field that `runner.quick_start` honours as the engine does (its draws need no
# history; its ends are the engine's): an unmarked field keeps ``run``'s quick start off unless it
# has its default
QUICK_START = {"quick_start": True}


@dataclass
class SamplingParams:
    n: int = 1
    """Number of completions to return for the prompt (each with its own random stream)."""
    temperature: float = field(default=1.0, metadata=QUICK_START)
    """Divides the logits before softmax; 0 means greedy (always the most likely token). >= 0."""
    top_p: float = field(default=1.0, metadata=QUICK_START)
    """Nucleus sampling: keep the smallest set of most likely tokens whose probabilities sum to at
    least top_p (Holtzman et al. 2019). In (0, 1]; 1 disables it."""
    top_k: int = field(default=-1, metadata=QUICK_START)
    """Keep only the k most likely tokens. -1 or 0 disables it."""
    min_p: float = field(default=0.0, metadata=QUICK_START)
    """Keep tokens whose probability is at least min_p times the most likely token's. In [0, 1]."""
    repetition_penalty: float = 1.0
    """Divide positive logits (multiply negative ones) of tokens already in the prompt or output by
    this (Keskar et al. 2019, CTRL). > 0; 1 disables it."""
    presence_penalty: float = 0.0
    """Subtract this from the logit of every token that has appeared in the output. In [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtract this times the count of each token in the output from its logit. In [-2, 2]."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit before sampling (values in [-100, 100])."""
    allowed_token_ids: list[int] | None = None
    """Only these tokens can be generated (vLLM's): every other logit is -inf."""
    bad_words: list[str] | None = None
    """Words never generated (vLLM's rule): each word's tokens, as it reads alone and after a
    space, are never completed: the last token of a word whose other tokens end the output so
    far is blocked (a one-token word always). The engine tokenizes them (`bad_words_token_ids`)."""
    seed: int | None = field(default=None, metadata=QUICK_START)
    """Seed of this request's random stream: the same seed gives the same text."""
    max_tokens: int = field(default=256, metadata=QUICK_START)
    """Most tokens to generate. >= 1, or 0 with `prompt_logprobs` (score the prompt only)."""
    min_tokens: int = 0
    """End-of-generation tokens are blocked until this many tokens were generated."""
    stop: list[str] | str | None = field(default=None, metadata=QUICK_START)
    """Strings that end generation; the stop string itself is not returned (unless
    include_stop_str_in_output)."""
    stop_token_ids: list[int] = field(default_factory=list, metadata=QUICK_START)
    """Token ids that end generation, besides the model's end-of-generation tokens."""
    include_stop_str_in_output: bool = field(default=False, metadata=QUICK_START)
    ignore_eos: bool = field(default=False, metadata=QUICK_START)
    """Keep generating past end-of-generation tokens (for benchmarks)."""
    logprobs: int | None = None
    """Return the log-probability of each chosen token and of the `logprobs` most likely
    alternatives (0 to the engine's ``max_logprobs``, 20 by default). Log-probabilities are of the model's raw distribution (log-softmax
    of the logits, before penalties, temperature and filtering), as in vLLM."""
    prompt_logprobs: int | None = None
    """Return the log-probability of every prompt token given the ones before it, and of the
    `prompt_logprobs` most likely tokens there (0 to ``max_logprobs``, as `logprobs`; vLLM's name). The prompt is then
    computed in full (no prefix cache). `RequestOutput.prompt_logprobs`, first entry None."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last k prompt tokens (vLLM's left truncation; -1: as many as the context
    length holds)."""
    skip_special_tokens: bool = field(default=True, metadata=QUICK_START)
    """Leave special (control) tokens out of the returned text."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (a dict of the same
    fields is accepted). Tokens the grammar does not allow are masked after the penalties and
    before temperature; see `nextoken.structured`."""
    watermark: bool = False
    """Watermark the output (Kirchenbauer et al. 2023; TGI's rule, see `nextoken.sample.watermark`):
    the engine's gamma of the vocabulary, chosen from the previous token, gets +delta."""
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False, compare=False)
    """`bad_words` as token id sequences, set by the engine when the request is added."""

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self, vocab_size: int | None = None, max_logprobs: int = MAX_LOGPROBS) -> "SamplingParams":
        """Check every field; raise `InvalidRequest` naming the first bad one. Returns self.
        `max_logprobs`: the most `logprobs` and `prompt_logprobs` taken (the engine's
        ``max_logprobs``; -1: the vocabulary, or no bound without `vocab_size`)."""
        most = (vocab_size if max_logprobs == -1 else max_logprobs)
        _int(self, "n", 1, 128)
        _num(self, "temperature", 0.0, 100.0)
        _num(self, "top_p", 0.0, 1.0, low_open=True)
        _int(self, "top_k", -1, None)
        _num(self, "min_p", 0.0, 1.0)
        _num(self, "repetition_penalty", 0.0, 100.0, low_open=True)
        _num(self, "presence_penalty", -2.0, 2.0)
        _num(self, "frequency_penalty", -2.0, 2.0)
        if self.prompt_logprobs is not None:
            _int(self, "prompt_logprobs", 0, most)
        _int(self, "max_tokens", 0 if self.prompt_logprobs is not None and self.n == 1 else 1, None)
        _int(self, "min_tokens", 0, self.max_tokens)
        if self.seed is not None:
            _int(self, "seed", -(2**63), 2**63 - 1)
        if self.logprobs is not None:
            _int(self, "logprobs", 0, most)
        if self.structured_outputs is not None:
            self.structured_outputs.kind()
            if self.ignore_eos:
                raise InvalidRequest("structured output cannot be combined with ignore_eos (the grammar ends "
                                     "the output with an end-of-generation token)", "ignore_eos")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest("stop must be a list of non-empty strings", "stop")
        for tid in self.stop_token_ids:
            _token_id(tid, "stop_token_ids", vocab_size)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            _int(self, "truncate_prompt_tokens", 1, None)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise InvalidRequest("allowed_token_ids must be a non-empty list of token ids", "allowed_token_ids")
            for tid in self.allowed_token_ids:
                _token_id(tid, "allowed_token_ids", vocab_size)
        if self.bad_words is not None and (not isinstance(self.bad_words, list) or
                                           not all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise InvalidRequest("bad_words must be a list of words (non-empty strings)", "bad_words")
        for tid, bias in (self.logit_bias or {}).items():
            _token_id(tid, "logit_bias", vocab_size)
            if not _is_num(bias) or not -100 <= bias <= 100:
                raise InvalidRequest(f"logit_bias[{tid}] must be a number in [-100, 100], got {bias!r}",
                                     "logit_bias")
        return self


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _num(p, name, lo, hi, low_open=False):
    v = getattr(p, name)
    ok = _is_num(v) and (v > lo if low_open else v >= lo) and v <= hi
    if not ok:
        rng = f"{'(' if low_open else '['}{lo}, {hi}]"
        raise InvalidRequest(f"{name} must be a number in {rng}, got {v!r}", name)


def _int(p, name, lo, hi):
    v = getattr(p, name)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise InvalidRequest(f"{name} must be an integer {rng}, got {v!r}", name)


def _token_id(tid, name, vocab_size):
    if not isinstance(tid, int) or isinstance(tid, bool) or tid < 0 or (vocab_size and tid >= vocab_size):
        limit = f" [0, {vocab_size})" if vocab_size else ""
        raise InvalidRequest(f"{name}: {tid!r} is not a token id in the vocabulary{limit}", name)
