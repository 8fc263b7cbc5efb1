"""The sampler: masks against `transformers`' logits warpers, statistics of the draws, seeds."""

from __future__ import annotations

import math

import pytest
import torch

from nextoken.sample.logits_processors import apply_presence_frequency, apply_repetition_penalty, process_logits
from nextoken.sample.sampler import Sampler, SamplerRequest, filter_mask, make_generator
from nextoken.sampling_params import SamplingParams

V = 50


def row(params: SamplingParams, seed=None, prompt=(), output=None):
    return SamplerRequest(params, list(prompt), output if output is not None else [], make_generator(seed))


def draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    s = Sampler()
    r = row(params, seed)
    return [s(logits[None], [r])[0].token for _ in range(n)]


def hf_mask(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Which tokens survive `transformers`' TopK -> TopP -> MinP warpers (independent oracle)."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = logits[None].clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    if min_p > 0:
        scores = MinPLogitsWarper(min_p)(ids, scores)
    return torch.isfinite(scores[0])


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (-1, 0.5, 0.0), (-1, 0.9, 0.0), (-1, 1.0, 0.1),
                                                (10, 0.8, 0.05), (1, 1.0, 0.0), (-1, 0.01, 0.0), (-1, 1.0, 0.0)])
def test_filter_mask_equals_transformers_warpers(top_k, top_p, min_p):
    g = torch.Generator().manual_seed(top_k + int(top_p * 100) + int(min_p * 1000))
    for _ in range(20):
        logits = torch.randn(V, generator=g) * 3
        assert torch.equal(filter_mask(logits, top_k, top_p, min_p), hf_mask(logits, top_k, top_p, min_p))


@pytest.mark.parametrize("params", [SamplingParams(top_k=3), SamplingParams(top_p=0.3), SamplingParams(min_p=0.3),
                                   SamplingParams(temperature=2.0, top_k=4, top_p=0.9)])
def test_draws_never_violate_the_mask(params):
    logits = torch.randn(V, generator=torch.Generator().manual_seed(1)) * 2
    allowed = set(filter_mask(logits / params.temperature, params.top_k, params.top_p, params.min_p)
                  .nonzero().flatten().tolist())
    drawn = set(draw(logits, params, 400))
    assert drawn <= allowed
    assert len(drawn) > 1  # it really samples


def test_temperature_sampling_follows_softmax_chi_square():
    """Counts of 20,000 draws against softmax(logits / T): chi-square goodness of fit. Drawn as
    200 steps of a batch of 100 seeded rows (each row's stream is what it draws alone:
    `test_seeded_draws_do_not_depend_on_the_batch`), 40 times faster than one row at a time."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    t = 0.7
    n = 20_000
    s, rows = Sampler(), [row(SamplingParams(temperature=t), seed=123 + i) for i in range(100)]
    batch = logits[None].expand(len(rows), -1).contiguous()
    tokens = [r.token for _ in range(n // len(rows)) for r in s(batch, rows)]
    observed = torch.bincount(torch.tensor(tokens), minlength=8).double()
    expected = (logits.double() / t).softmax(-1) * n
    from scipy import stats  # where used: it takes a second to import
    _, p = stats.chisquare(observed.numpy(), expected.numpy())
    assert p > 1e-3
    # and a wrong temperature is rejected by the same test: it has the power to fail
    wrong = logits.double().softmax(-1) * n
    assert stats.chisquare(observed.numpy(), wrong.numpy())[1] < 1e-6


def test_greedy_is_argmax():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    s = Sampler()
    res = s(logits, [row(SamplingParams(temperature=0)) for _ in range(4)])
    assert [r.token for r in res] == logits.argmax(-1).tolist()


def test_seeded_draws_do_not_depend_on_the_batch():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    p = SamplingParams(temperature=1.0)
    s = Sampler()
    alone = [s(logits[1:2], [r])[0].token for r in [row(p, seed=7)] for _ in range(20)]
    r7 = row(p, seed=7)
    batched = [s(logits, [row(p, seed=1), r7, row(p, seed=None)])[1].token for _ in range(20)]
    assert alone == batched
    r8 = row(p, seed=8)
    assert [s(logits[1:2], [r8])[0].token for _ in range(20)] != alone


def test_repetition_penalty_equals_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(V, generator=torch.Generator().manual_seed(5))
    seen = torch.tensor([1, 4, 9, 20])
    expected = RepetitionPenaltyLogitsProcessor(1.3)(seen[None], logits[None].clone())[0]
    assert torch.allclose(apply_repetition_penalty(logits[seen], 1.3), expected[seen])
    # and through the batched processors: prompt 1, 4 and output 9, 20, 9
    got = process_logits(logits, SamplingParams(repetition_penalty=1.3), [1, 4], [9, 20, 9], frozenset())
    assert torch.allclose(got, expected)


def test_presence_and_frequency_penalties_follow_openai_formula():
    logits = torch.zeros(6)
    counts = torch.tensor([0, 1, 3, 0, 2, 0])
    got = apply_presence_frequency(logits, counts, presence=0.5, frequency=0.25)
    # mu[j] - alpha_frequency * c[j] - alpha_presence * (c[j] > 0)
    assert got.tolist() == [0.0, -0.75, -1.25, 0.0, -1.0, 0.0]


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([3.0, 2.9, 0.0])
    p = SamplingParams(temperature=0, presence_penalty=1.0)
    assert Sampler()(logits[None], [row(p, output=[0])])[0].token == 1
    assert Sampler()(logits[None], [row(p, output=[])])[0].token == 0


def test_logit_bias_and_min_tokens():
    logits = torch.tensor([0.0, 5.0, 1.0])
    s = Sampler(eog_ids=frozenset({1}))
    assert s(logits[None], [row(SamplingParams(temperature=0, logit_bias={2: 10.0}))])[0].token == 2
    assert s(logits[None], [row(SamplingParams(temperature=0, min_tokens=2), output=[0])])[0].token == 2
    assert s(logits[None], [row(SamplingParams(temperature=0, min_tokens=2), output=[0, 0])])[0].token == 1


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.randn(V, generator=torch.Generator().manual_seed(6))
    p = SamplingParams(temperature=0.5, top_k=3, logprobs=4)
    res = Sampler()(logits[None], [row(p, seed=1)])[0]
    raw = logits.log_softmax(-1)
    assert math.isclose(res.logprob, float(raw[res.token]), rel_tol=1e-6)
    assert [t for t, _ in res.top_logprobs] == raw.topk(4).indices.tolist()
    assert all(a >= b for (_, a), (_, b) in zip(res.top_logprobs, res.top_logprobs[1:]))


def test_the_callers_logits_are_never_changed():
    """Penalties edit a copy: the raw logits stay intact for logprobs and `nextoken explain`."""
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(8))
    before = logits.clone()
    p = SamplingParams(temperature=0, repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5,
                       logit_bias={3: 50.0}, min_tokens=5)
    Sampler(eog_ids=frozenset({1}))(logits, [row(p, prompt=[4, 5], output=[6, 6]), row(SamplingParams(temperature=0))])
    assert torch.equal(logits, before)
