"""Beam search over the batching engine.

Each step, every live beam of every prompt is one engine request (the beam's tokens as prompt,
one new token, its top 2W log-probabilities); they run batched with whatever else the engine
serves. The engine drives the searches itself (`engine.beam_groups`), so a search queues its next
step before the next schedule and keeps its place under load. Beams share the KV blocks of their
common prefix through the prefix cache (ref-counted full blocks, found by their chained hashes),
so a beam costs only its own new blocks; the part-filled last block, which beams cannot share
(each writes its own next token there), is copied from the parent step's request, which left it
cached when it ended (`KVCacheManager.get_partial_block`): a step computes one token a beam.

Selection is `transformers`' beam search (``generate(num_beams=W, do_sample=False)``):

- candidates: every beam's cumulative log-probability plus each next token's; the best 2W;
- a candidate ending in an end-of-generation token, or reaching max_tokens, that ranks in the
  first W becomes a finished hypothesis with score ``logprob / generated_len ** length_penalty``;
  the best W hypotheses are kept;
- the best W candidates that did not finish are the next step's beams;
- search stops at max_tokens, or once W hypotheses are kept and the best live beam, scored at
  its current length, cannot beat the worst of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nextoken.errors import InvalidRequest, RequestFailed
from nextoken.sampling_params import SamplingParams


@dataclass
class BeamSequence:
    """One finished beam: generated ids and text, summed log-probability, length-normalised score."""

    token_ids: list[int]
    text: str
    cumulative_logprob: float
    score: float


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best score first."""

    prompt_ids: list[int]
    sequences: list[BeamSequence] = field(default_factory=list)


@dataclass
class _Search:
    prompt_ids: list[int]
    beams: list[tuple[list[int], float]]  # (generated ids, cumulative logprob)
    finished: list[tuple[list[int], float, float]] = field(default_factory=list)  # (ids, logprob, score)
    done: bool = False


def length_score(logprob: float, length: int, penalty: float) -> float:
    """A hypothesis' score, ``logprob / length ** penalty`` (`transformers`' beam scorer; `length`
    generated tokens, >= 1). An extreme `penalty` (1e16 or -1e16: any finite float is accepted)
    scores as the formula's limit instead of raising: the power overflows (OverflowError) or
    underflows to 0 (ZeroDivisionError), and either once stopped the engine's step loop."""
    try:
        return logprob / (length ** penalty)
    except (OverflowError, ZeroDivisionError):
        if penalty > 0 or logprob == 0:  # a huge divisor
            return 0.0 * logprob
        return -math.inf  # a vanishing divisor under a negative log-probability


class BeamSearch:
    """The search state of several prompts; a driver runs `pending` and feeds `advance`."""

    def __init__(self, prompts: list[list[int]], beam_width: int, max_tokens: int, length_penalty: float,
                 ignore_eos: bool, eog_ids: frozenset[int]):
        if not 1 <= beam_width <= 10:
            raise InvalidRequest(f"beam_width must be in 1..10, got {beam_width}", "beam_width")
        if max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        self.width, self.max_tokens, self.length_penalty = beam_width, max_tokens, length_penalty
        self.eog = frozenset() if ignore_eos else eog_ids
        self.searches = [_Search(list(p), [([], 0.0)]) for p in prompts]
        # per search, per step: every candidate considered (its prefix, token, cumulative
        # log-probability) and what became of it ("beam", "finished" or "pruned"), for the inspector
        self.tree: list[list[list[dict]]] = [[] for _ in prompts]
        self.step = 0
        # one next token per beam, with the top 2W alternatives (raw log-probabilities)
        self.params = SamplingParams(temperature=0, max_tokens=1, logprobs=2 * beam_width, ignore_eos=True)
        self._batch: list[tuple[_Search, tuple[list[int], float]]] = []

    @property
    def done(self) -> bool:
        return all(s.done for s in self.searches)

    def pending(self) -> list[list[int]]:
        """The token ids (prompt + beam) whose next-token log-probabilities this step needs."""
        self._batch = [(s, b) for s in self.searches if not s.done for b in s.beams]
        return [s.prompt_ids + ids for s, (ids, _) in self._batch]

    def advance(self, top: list[list[tuple[int, float]]]) -> None:
        """`top[i]`: the best 2W ``(token, logprob)`` after ``pending()[i]``."""
        w, last = self.width, self.step == self.max_tokens - 1
        for s in {id(s): s for s, _ in self._batch}.values():
            cands = [(lp + tlp, ids + [tok]) for (owner, (ids, lp)), alts in zip(self._batch, top) if owner is s
                     for tok, tlp in alts]
            cands.sort(key=lambda c: -c[0])
            running = []
            fate = ["pruned"] * len(cands)
            for rank, (lp, ids) in enumerate(cands[: 2 * w]):
                if last or ids[-1] in self.eog:
                    if rank < w:
                        s.finished.append((ids, lp, length_score(lp, len(ids), self.length_penalty)))
                        fate[rank] = "finished"
                elif len(running) < w:
                    running.append((ids, lp))
                    fate[rank] = "beam"
            self.tree[self.searches.index(s)].append(
                [{"prefix": ids[:-1], "token": ids[-1], "cumulative_logprob": lp, "fate": f}
                 for (lp, ids), f in zip(cands, fate)])
            s.finished = sorted(s.finished, key=lambda f: -f[2])[:w]
            s.beams = running
            if not running or last:
                s.done = True
            elif len(s.finished) == w:  # can the best live beam still beat the worst kept?
                s.done = length_score(running[0][1], len(running[0][0]), self.length_penalty) <= s.finished[-1][2]
        self.step += 1

    def outputs(self, tokenizer) -> list[BeamSearchOutput]:
        return [BeamSearchOutput(s.prompt_ids, [
            BeamSequence(ids, tokenizer.decode(ids, skip_special_tokens=True), lp, score)
            for ids, lp, score in s.finished]) for s in self.searches]


def top_alternatives(out) -> list[tuple[int, float]]:
    """The next-token alternatives of a one-token `RequestOutput`, best first. Raises
    `RequestFailed` when the request failed (a model fault in its pass: the search cannot go on)."""
    if out.error is not None:
        raise RequestFailed(out.error)
    lps = out.outputs[0].logprobs[0]
    return sorted(lps.items(), key=lambda kv: -kv[1])


def beam_search(engine, prompts: list[list[int]], beam_width: int, max_tokens: int, length_penalty: float = 1.0,
                ignore_eos: bool = False) -> list[BeamSearchOutput]:
    """Beam search for each prompt (token ids) on an `LLMEngine`, the searches driven by the
    engine (`LLMEngine.add_beam_search`), all their beams batched each step. Raises
    `InvalidRequest` for a width or length out of range, `RequestFailed` when a beam's pass failed."""
    searches = [BeamSearch([p], beam_width, max_tokens, length_penalty, ignore_eos, engine.tokenizer.eog_token_ids)
                for p in prompts]
    rids = [engine.add_beam_search(p, s) for p, s in zip(prompts, searches)]
    for out in engine.run_until_finished(rids):
        if out.error is not None:
            raise RequestFailed(out.error)
    return [s.outputs(engine.tokenizer)[0] for s in searches]
