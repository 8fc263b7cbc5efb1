"""The batched sampler against the row-by-row reference (`tests/helpers/sampler_reference.py`): the same
kept sets and distributions for every kind of row in one mixed batch, the same token for the same
seed, step after step; the C draw against the PyTorch one; seeded requests alone and batched."""

from __future__ import annotations

import math

import pytest
import torch

from nextoken import kernels
from nextoken.sample.sampler import Sampler, SamplerRequest, filter_masks, make_generator, torch_draw
from nextoken.sample.watermark import WatermarkConfig
from nextoken.sampling_params import SamplingParams
from tests.helpers import sampler_reference as ref

V = 1000
EOG = frozenset({2})
WATERMARK = WatermarkConfig(0.5, 2.0)


class Grammar:
    """A stand-in grammar: a fixed allowed set; `fast` lets the sampler try the unmasked draw."""

    def __init__(self, allowed: torch.Tensor, fast: bool):
        self.allowed, self.fast = allowed, fast

    def refused(self, ahead=()):
        return ~self.allowed

    def forced(self):
        return not self.fast

    def allows(self, token):
        return bool(self.allowed[token])


def allowed_set(seed: int) -> torch.Tensor:
    a = torch.rand(V, generator=torch.Generator().manual_seed(seed)) < 0.2
    a[EOG_ID] = True
    return a


EOG_ID = 2
MIXED = [  # (params, grammar)
    (SamplingParams(temperature=0), None),
    (SamplingParams(temperature=1.0), None),
    (SamplingParams(temperature=0.7, top_p=0.9), None),
    (SamplingParams(temperature=1.0, top_k=50, top_p=0.95, min_p=0.05, repetition_penalty=1.1,
                    presence_penalty=0.5), None),
    (SamplingParams(temperature=0.8, top_k=5), None),
    (SamplingParams(temperature=1.2, min_p=0.1, frequency_penalty=0.7), None),
    (SamplingParams(temperature=0, repetition_penalty=1.3, logit_bias={3: 5.0, 7: -100.0}), None),
    (SamplingParams(temperature=1.0, logit_bias={5: 10.0}, min_tokens=3, stop_token_ids=[9]), None),
    (SamplingParams(temperature=0.9, watermark=True), None),
    (SamplingParams(temperature=1.0, top_p=0.5, logprobs=3), None),
    (SamplingParams(temperature=0, logprobs=0, presence_penalty=1.5), None),
    (SamplingParams(temperature=1.0, top_k=10, min_tokens=2), "masked"),
    (SamplingParams(temperature=0.6, repetition_penalty=1.2), "masked"),
    (SamplingParams(temperature=0.5, logprobs=2), "fast"),
    (SamplingParams(temperature=0), "fast"),
]


def batch(seed: int, native: bool = True):
    rows = []
    for i, (p, g) in enumerate(MIXED):
        grammar = Grammar(allowed_set(100 + i), g == "fast") if g else None
        rows.append(SamplerRequest(p.validate(V), [4, 5, 6, 4, 11 + i], [], make_generator(seed * 100 + i), grammar))
    return rows


def logits_for(step: int) -> torch.Tensor:
    return torch.randn(len(MIXED), V, generator=torch.Generator().manual_seed(1000 + step)) * 3


@pytest.mark.parametrize("native", [True, False])
def test_distributions_equal_the_reference(native):
    sampler = Sampler(EOG, WATERMARK, kernel=kernels.load("sampling") if native else None)
    rows = batch(0)
    for step in range(4):
        logits = logits_for(step)
        dists = sampler.distributions(logits, rows)
        for i, (row, (kept, probs)) in enumerate(zip(rows, dists)):
            rkept, w = ref.distribution(logits[i], row, row.output_ids, EOG, WATERMARK)
            if w is None:
                assert probs is None and kept == rkept, i
                continue
            assert torch.equal(kept, rkept), (step, i)
            assert torch.allclose(probs, w / w.sum(), atol=1e-7), (step, i)
        for row in rows:  # grow every history (penalties, min_tokens) with a token the grammar allows
            row.output_ids.append(int(row.grammar.allowed.nonzero()[step]) if row.grammar else 3 + step)


@pytest.mark.parametrize("native", [True, False])
def test_tokens_equal_the_reference_for_the_same_seed(native):
    """Step after step, the batch's tokens are the reference's for generators with the same seeds
    (the rows under a grammar that try the unmasked draw first draw allowed tokens)."""
    sampler = Sampler(EOG, WATERMARK, kernel=kernels.load("sampling") if native else None)
    assert (sampler.kernel is not None) == native
    ours, theirs = batch(1), batch(1)
    for step in range(12):
        logits = logits_for(step)
        before = logits.clone()
        got = sampler(logits, ours)
        want = ref.sample(logits, theirs, EOG, WATERMARK)
        assert torch.equal(logits, before)  # the caller's logits are never changed
        for i, (res, t) in enumerate(zip(got, want)):
            if MIXED[i][1] == "fast" and not MIXED[i][0].greedy:
                assert ours[i].grammar.allows(res.token)
                t = res.token  # its stream consumed a different number of draws: follow ours
            else:
                assert res.token == t, (step, i)
            if MIXED[i][0].logprobs is not None:
                raw = logits[i].log_softmax(-1)
                assert math.isclose(res.logprob, float(raw[res.token]), rel_tol=1e-6)
                assert [x for x, _ in res.top_logprobs] == raw.topk(MIXED[i][0].logprobs).indices.tolist()
            ours[i].output_ids.append(res.token)
            theirs[i].output_ids.append(t)


def test_fast_grammar_rows_draw_the_masked_distribution():
    """Chi-square: the unmasked-first draw of a grammar row follows the masked distribution."""
    from scipy import stats

    sampler = Sampler(EOG)
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(3)) * 2
    allowed = torch.zeros(40, dtype=torch.bool)
    allowed[[1, 4, 7, 20, 33]] = True
    p = SamplingParams(temperature=1.0)
    row = SamplerRequest(p, [0], [], make_generator(5), Grammar(allowed, fast=True))
    n = 4000
    counts = torch.bincount(torch.tensor([sampler(logits, [row])[0].token for _ in range(n)]), minlength=40)
    assert counts[~allowed].sum() == 0
    probs = logits[0].double().masked_fill(~allowed, float("-inf")).softmax(-1)[allowed]
    observed = counts[allowed].double().numpy()
    assert stats.chisquare(observed, (probs / probs.sum() * observed.sum()).numpy())[1] > 1e-3


@pytest.mark.parametrize("vocab", [49152, 151936, 1003])
def test_kernel_equals_the_pytorch_draw(vocab):
    """The C draw (no sort of the vocabulary) against `torch_draw` (sorts): peaked and flat rows,
    rows with masked (-inf) tokens, rows of many ties (logits in steps of 1/2), every filter alone
    and together (a flat row's top-p and a large top-k take the kernel's preselection by buckets)."""
    sampler = Sampler(kernel=kernels.load("sampling"))
    assert sampler.kernel is not None, "the sampling kernel did not build (is gcc installed?)"
    g = torch.Generator().manual_seed(vocab)
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.5, 1.0, 2.0, 0.9])
    top_k = torch.tensor([0, 0, 0, 50, 5, 0, 700, 1], dtype=torch.int32)
    top_p = torch.tensor([1, 1, 0.9, 0.95, 1, 0.5, 0.8, 1], dtype=torch.float32)
    min_p = torch.tensor([0, 0, 0, 0.05, 0, 0.1, 0, 0], dtype=torch.float32)
    for trial in range(8):
        logits = torch.randn(8, vocab, generator=g) * (1 + 3 * (trial % 6))  # flat to peaked
        if trial % 3 == 0:
            logits[:, ::3] = float("-inf")
        if trial >= 6:
            logits = torch.round(logits * 2) / 2
        u = torch.rand(8, generator=g)
        want = torch_draw(logits, temp, top_k, top_p, min_p, u)
        got = sampler.kernel([logits[i].data_ptr() for i in range(8)], vocab,
                             tuple(t.data_ptr() for t in (temp, top_k, top_p, min_p)), u.tolist())[0]
        assert torch.equal(got, want), trial


@pytest.mark.parametrize("vocab", [151936, 1003])
def test_kept_masks_equal_the_pytorch_rule(vocab):
    """The C kernel's kept sets (`_Kernel.kept_masks`, what the whole distributions take on the
    CPU) against `filter_masks` (sorts), on the draw test's rows: equal on every token of weight
    above 0 (the kernel's e is 0 from x - max <= -87 on, and a filter keeps no token of weight 0
    there); a row without a filter keeps every token in both."""
    sampler = Sampler(kernel=kernels.load("sampling"))
    g = torch.Generator().manual_seed(vocab + 1)
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.5, 1.0, 2.0, 0.9])
    top_k = torch.tensor([0, 0, 0, 50, 5, 0, 700, 1], dtype=torch.int32)
    top_p = torch.tensor([1, 1, 0.9, 0.95, 1, 0.5, 0.8, 1], dtype=torch.float32)
    min_p = torch.tensor([0, 0, 0, 0.05, 0, 0.1, 0, 0], dtype=torch.float32)
    settings = tuple(t.data_ptr() for t in (temp, top_k, top_p, min_p))
    for trial in range(8):
        logits = torch.randn(8, vocab, generator=g) * (1 + 3 * (trial % 6))
        if trial % 3 == 0:
            logits[:, ::3] = float("-inf")
        if trial >= 6:
            logits = torch.round(logits * 2) / 2
        got = sampler.kernel.kept_masks(logits, settings)
        sampled = temp > 0
        x = logits[sampled] / temp[sampled, None]
        k, p, m = top_k[sampled], top_p[sampled], min_p[sampled]
        weighed = (x - x.max(-1, keepdim=True).values > -87) | ((k <= 0) & (p >= 1) & (m <= 0))[:, None]
        assert torch.equal(got[sampled], filter_masks(x, k, p, m) & weighed), trial
        assert got[~sampled].all()  # (a greedy row: left to the caller)


@pytest.mark.parametrize("build", ["native", "portable"])
def test_greedy_rows_take_the_first_maximum(build):
    """The greedy draw (`row_argmax`: one pass, two sets of 8 lanes each keeping its maximum and
    first index where AVX2 is there, else the plain loop) against PyTorch's argmax, which returns
    the first maximum: ties within one block of 16 (across the two sets of lanes), across blocks,
    in the vector loop's tail, at the last place, a constant row, an all -inf row, masked (-inf)
    tokens, and rows of a few values (ties everywhere). (A NaN row's token is never used: the
    engine fails it, `Sampler.finite_rows`.)"""
    sampler = Sampler(kernel=kernels.load("sampling", portable=build == "portable"))
    vocab = 1003  # 62 blocks of 16 and a tail of 11
    logits = torch.randn(10, vocab, generator=torch.Generator().manual_seed(3))
    for row, places in enumerate([(5, 9), (17, 900), (995, 1000), (29, vocab - 1), (40, 41, 42), (993, 999)]):
        logits[row, list(places)] = 9.0
    logits[6] = 1.5
    logits[7] = float("-inf")
    logits[8, ::2] = float("-inf")
    logits[8, 300] = 9.0
    logits[9, 16] = logits[9, 15] = 9.0
    want = logits.argmax(-1)
    zero, ones = torch.zeros(10), torch.ones(10)
    top_k = zero.int()
    got = sampler.kernel([logits[i].data_ptr() for i in range(10)], vocab,
                         tuple(t.data_ptr() for t in (zero, top_k, ones, zero)), [0.0] * 10)[0]
    assert got.tolist() == want.tolist() == [5, 17, 995, 29, 40, 993, 0, 0, 300, 15]
    for vocab in (16, 17, 4099, 49152):
        few = torch.randint(0, 40, (10, vocab), generator=torch.Generator().manual_seed(vocab)).float()
        got = sampler.kernel([few[i].data_ptr() for i in range(10)], vocab,
                             tuple(t.data_ptr() for t in (zero, top_k, ones, zero)), [0.0] * 10)[0]
        assert got.tolist() == few.argmax(-1).tolist(), vocab


def test_finite_rows_kernel_equals_the_plain_check():
    """``rows_finite`` (the engine's check before sampling; a decode step's draw finds it in its
    first pass over each row instead, ``sample_rows``' ``finite``, greedy and sampled) against the
    plain path and the definition (no NaN, no +-inf in the row): each kind of bad value at the
    first place, in the middle, in the vector loop's tail, and in a strided view's rows."""
    with_kernel, plain = Sampler(kernel=kernels.load("sampling")), Sampler()
    assert with_kernel.kernel is not None and plain.kernel is None
    vocab = 1003
    logits = torch.randn(12, vocab) * 1e36  # (huge but finite)
    logits[0] = float("-inf")
    logits[0, 7] = 0.0
    for row, (at, bad) in enumerate([(0, "nan"), (500, "inf"), (vocab - 1, "-inf"), (vocab - 3, "nan")], start=1):
        logits[row, at] = float(bad)
    logits[6] = 3.0  # constant rows
    want = [bool(torch.isfinite(r).all()) for r in logits]
    assert want[:5] == [False] * 5 and all(want[5:])
    assert with_kernel.finite_rows(logits) == plain.finite_rows(logits) == want
    rows, zero, ones = [logits[i].data_ptr() for i in range(12)], torch.zeros(12), torch.ones(12)
    top_k = torch.zeros(12, dtype=torch.int32)
    for temperature in (zero, ones):  # the greedy pass (`row_argmax`) and the sampled one (`row_max`)
        settings = tuple(t.data_ptr() for t in (temperature, top_k, ones, zero))
        assert with_kernel.kernel(rows, vocab, settings, [0.5] * 12, check_finite=True)[1] == want
        assert with_kernel.kernel(rows, vocab, settings, [0.5] * 12)[1] is None
    view = logits.T.contiguous().T[::2]  # rows of a transposed copy: not unit-stride along the vocabulary
    assert with_kernel.finite_rows(view) == want[::2]
    small = torch.randn(3, vocab)
    small[1, 11] = float("nan")
    assert with_kernel.finite_rows(small) == plain.finite_rows(small) == [True, False, True]


def test_a_seeded_row_draws_the_same_alone_and_in_any_batch():
    sampler = Sampler(EOG)
    p = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1).validate(V)
    alone_row = SamplerRequest(p, [4, 5], [], make_generator(42))
    batched_row = SamplerRequest(p, [4, 5], [], make_generator(42))
    others = batch(7)
    for step in range(10):
        logits = logits_for(step)
        a = sampler(logits[3:4], [alone_row])[0].token
        mixed = others[:3] + [batched_row] + others[4:]
        b = sampler(logits, mixed)[3].token
        assert a == b, step
        alone_row.output_ids.append(a)
        batched_row.output_ids.append(b)


def test_distributions_with_tokens_ahead_equal_the_reference():
    """Verification's histories: the output plus drafted tokens ahead (counted by the penalties and
    min_tokens as output, never stored in the request's own history)."""
    sampler = Sampler(EOG)
    p = SamplingParams(temperature=0.9, top_k=30, repetition_penalty=1.2, presence_penalty=0.4,
                       frequency_penalty=0.3, min_tokens=5, logit_bias={8: 2.0}).validate(V)
    row = SamplerRequest(p, [4, 5, 6], [7, 7, 9], make_generator(0))
    drafts = [7, 12, 2, 12]
    logits = logits_for(3)[:5]
    hist = [row.output_ids + drafts[:i] for i in range(5)]
    for i, (kept, probs) in enumerate(sampler.distributions(logits, [row] * 5, hist)):
        rkept, w = ref.distribution(logits[i], row, hist[i], EOG)
        assert torch.equal(kept, rkept) and torch.allclose(probs, w / w.sum(), atol=1e-7), i
    assert row.output_ids == [7, 7, 9] and row.history.arrays()[1].sum() == 3  # its own history untouched
