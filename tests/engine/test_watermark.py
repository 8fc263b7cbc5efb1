"""The green-list watermark: green lists against a direct re-implementation of TGI's rule,
z-scores of synthetic sequences, and SmolLM2 text with and without it."""

from __future__ import annotations

import math

import pytest
import torch

from nextoken import LLM, SamplingParams
from nextoken.sample.sampler import Sampler, SamplerRequest
from nextoken.sample.watermark import WatermarkConfig, detect, green_mask


def tgi_greenlist(prev_token: int, scores: torch.Tensor, gamma: float) -> torch.Tensor:
    """TGI's WatermarkLogitsProcessor, written out: a CPU generator seeded with
    15485863 * previous token, randperm over the scores' width, the first gamma share."""
    rng = torch.Generator(device="cpu")
    rng.manual_seed(15485863 * prev_token)
    perm = torch.randperm(scores.shape[-1], device=scores.device, generator=rng)
    return perm[: int(scores.shape[-1] * gamma)]


@pytest.mark.parametrize("gamma", [0.25, 0.5])
def test_green_lists_equal_tgi_rule(gamma):
    scores = torch.zeros(1, 1000)
    for prev in (0, 1, 7, 999, 49151):
        ids = tgi_greenlist(prev, scores, gamma)
        mask = green_mask(prev, 1000, gamma)
        assert set(torch.nonzero(mask).flatten().tolist()) == set(ids.tolist())


def test_sampler_adds_delta_to_green_logits_after_the_previous_token():
    logits = torch.randn(300)
    cfg = WatermarkConfig(0.5, 2.0)
    row = SamplerRequest(SamplingParams(temperature=1.0, watermark=True), [5, 9], [11], None)
    _, probs = Sampler(watermark=cfg).distribution(logits, row)
    expected = logits.clone()
    expected[tgi_greenlist(11, logits, 0.5)] += 2.0  # seeded from the last output token
    torch.testing.assert_close(probs, expected.softmax(-1))
    # a drafted position is seeded from its own predecessor (the draft before it)
    _, probs = Sampler(watermark=cfg).distribution(logits, row, [11, 42])
    expected = logits.clone()
    expected[tgi_greenlist(42, logits, 0.5)] += 2.0
    torch.testing.assert_close(probs, expected.softmax(-1))


def test_z_scores_of_synthetic_sequences():
    vocab, gamma, n = 500, 0.5, 200
    g = torch.Generator().manual_seed(0)
    seq = [3]
    for _ in range(n):  # every token green: |s|_G = T
        seq.append(int(torch.nonzero(green_mask(seq[-1], vocab, gamma)).flatten()[0]))
    res = detect(seq, vocab, gamma)
    assert res.num_tokens_scored == n and res.num_green_tokens == n
    assert res.z_score == pytest.approx((n - gamma * n) / math.sqrt(n * gamma * (1 - gamma)))
    assert res.watermarked
    zs = [detect(torch.randint(0, vocab, (n + 1,), generator=g).tolist(), vocab, gamma).z_score for _ in range(40)]
    assert sum(abs(z) < 2 for z in zs) >= 34  # about standard normal: 95% within 2
    assert detect([1], vocab, gamma).num_tokens_scored == 0


def test_watermarked_smollm2_text_is_detected_and_plain_text_is_not(smollm2_path):
    llm = LLM(str(smollm2_path), max_num_seqs=12)
    prompt = "<|im_start|>user\nWrite a long story about a lighthouse keeper.<|im_end|>\n<|im_start|>assistant\n"
    vocab = llm.engine.config.vocab_size
    # unmarked text's z is about standard normal (repeated tokens make it only about): within 3;
    # marked text's grows as sqrt(tokens): 120 give about 7 (measured: 5.3-6.7 at 100, 8.7-9.7 at 200)
    checks = ((True, lambda z: z > 4), (False, lambda z: abs(z) < 3))
    params = [SamplingParams(temperature=1.0, max_tokens=120, ignore_eos=False, seed=5, n=6, watermark=mark,
                             min_tokens=120) for mark, _ in checks]
    outs = llm.generate([prompt, prompt], params)  # marked and plain in one batch
    for (mark, check), out in zip(checks, outs):
        zs = [detect(list(c.token_ids), vocab, 0.5).z_score for c in out.outputs]
        assert sum(check(z) for z in zs) >= 5, (mark, zs)
