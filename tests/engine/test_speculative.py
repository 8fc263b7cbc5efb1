"""Speculative decoding: n-gram proposals, exact verification (statistically: the emitted
tokens follow the target's distribution, not the draft's), and the engine with both proposers
(greedy output unchanged, limits respected, every KV block back)."""

from __future__ import annotations

import pytest
import torch

from nextoken.errors import ModelLoadError
from nextoken.llm import LLM
from nextoken.sample.sampler import Sampler, SamplerRequest, make_generator
from nextoken.sampling_params import SamplingParams
from nextoken.spec_decode.ngram import propose_ngram
from nextoken.spec_decode.verify import verify
from tests.helpers.engine import assert_no_leak
from tests.tiny_models import tiny_hf_model, write_gguf

QUANT = {"attn_q.weight": "Q8_0", "attn_k.weight": "Q8_0", "attn_v.weight": "Q8_0", "attn_output.weight": "Q8_0",
         "ffn_gate.weight": "Q8_0", "ffn_up.weight": "Q8_0", "ffn_down.weight": "Q8_0"}


def test_ngram_proposes_the_latest_continuation_of_the_longest_suffix():
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert propose_ngram(toks, 3) == [7, 8, 5]  # "2 3" last seen before "7 8 5" (not "9 9 1")
    assert propose_ngram(toks, 1) == [7]
    assert propose_ngram([4, 5, 6], 2) == []  # nothing repeats
    assert propose_ngram([7, 7, 7, 7], 4) == [7]  # the most recent occurrence with a continuation
    assert propose_ngram([1, 2, 1, 2], 5, ngram_max=2) == [1, 2]
    assert propose_ngram([1, 2, 1], 0) == []
    # prefer an occurrence followed by k tokens: [3, 1] at 2 is followed by 3 tokens, at 5 by 2
    assert propose_ngram([1, 2, 3, 1, 2, 3, 1], 3, ngram_max=2) == [2, 3, 1]


def row(temperature: float, seed: int) -> SamplerRequest:
    return SamplerRequest(SamplingParams(temperature=temperature, seed=seed), [1], [], make_generator(seed))


def test_verify_greedy_accepts_exactly_the_argmax_prefix():
    logits = torch.full((4, 6), -5.0)
    for i, t in enumerate([2, 3, 0, 5]):
        logits[i, t] = 5.0  # the target's argmax after 0, 1, 2, 3 drafts
    sampler = Sampler()
    out, accepted = verify(sampler, logits, [2, 3, 4], None, row(0.0, 0))
    assert accepted == 2 and [r.token for r in out] == [2, 3, 0]  # third draft wrong: the argmax instead
    out, accepted = verify(sampler, logits, [2, 3, 0], None, row(0.0, 0))
    assert accepted == 3 and [r.token for r in out] == [2, 3, 0, 5]  # all accepted, plus the bonus token


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_speculative_sampling_draws_from_the_target(proposer):
    """First emitted token over 20000 verifications: distributed as the target p, whatever the
    draft q (a distribution, or a fixed n-gram guess). The test would reject q itself."""
    torch.manual_seed(0)
    p = torch.tensor([0.35, 0.05, 0.25, 0.15, 0.12, 0.08])
    q = torch.tensor([0.05, 0.40, 0.10, 0.05, 0.30, 0.10])
    logits = p.log().repeat(2, 1)  # temperature 1: the sampler's distribution is p
    sampler = Sampler()
    r = row(1.0, 1234)
    draws = torch.multinomial(q, 20000, replacement=True, generator=torch.Generator().manual_seed(7))
    counts = torch.zeros(6)
    accepted = 0
    for x in draws.tolist():
        if proposer == "draft":
            out, a = verify(sampler, logits, [x], [q], r)
        else:
            out, a = verify(sampler, logits, [1], None, r)  # always guesses token 1 (p = 0.05)
        counts[out[0].token] += 1
        accepted += a
    n = counts.sum()
    from scipy.stats import chisquare  # where used: scipy.stats takes a second to import
    assert chisquare(counts.numpy(), (p * n).numpy()).pvalue > 1e-3
    assert chisquare(counts.numpy(), (q * n).numpy()).pvalue < 1e-6  # it is not the draft's
    expected = float(torch.minimum(p, q).sum()) if proposer == "draft" else 0.05  # acceptance rate
    assert abs(accepted / 20000 - expected) < 0.02


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny quantized qwen2 target, and as its draft the same model with noise on every weight
    (same vocabulary; it agrees often, not always). (The tiny llama, with its tied head, only
    ever repeats its last token: every guess would be right.)"""
    d = tmp_path_factory.mktemp("spec")
    paths = []
    for noise in (0.0, 0.2):
        hf = tiny_hf_model("qwen2", seed=3)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(5)
            for p in hf.parameters():
                p.add_(noise * p.std() * torch.randn(p.shape, generator=gen))
        path = d / f"tiny-{noise}.gguf"
        write_gguf(hf, path, "qwen2", quant=QUANT)
        paths.append(str(path))
    return paths


PROMPTS = [[5, 17, 200, 33, 41, 5, 17, 200, 33, 41, 5, 17], [90, 91, 92, 93] * 4, list(range(40, 75)), [7, 8, 9]]


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_greedy_output_unchanged(tiny_pair, method, max_num_seqs):
    target, draft = tiny_pair
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(target, max_num_seqs=max_num_seqs, dense_weights=False).generate(PROMPTS, params)
    kw = {"speculative_model": draft} if method == "draft" else {"speculative_method": "ngram"}
    llm = LLM(target, max_num_seqs=max_num_seqs, dense_weights=False, num_speculative_tokens=3, **kw)
    spec = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.stats()
    assert stats["spec_num_drafted_tokens"] > 0 and stats["spec_num_accepted_tokens"] > 0
    assert stats["spec_mean_accepted_length"] > 1.0
    assert stats["spec_num_accepted_tokens"] < stats["spec_num_drafted_tokens"]  # rejections, rolled back
    assert_no_leak(llm)


def test_ngram_draft_length_adapts_only_where_rows_are_dear(tiny_pair):
    """N-gram drafts keep their full length where a verification's extra rows cost about one
    row's (the codes on the AVX-512 VNNI loop, or a GPU: `ExecutionPlan.cheap_verification`), and
    otherwise adapt (one longer than the last accepted run; drafting backs off after a full
    rejection). Both policies, forced on any machine, emit the plain greedy tokens, and the fixed
    length drafts more tokens than the adapting one on prompts with rejections."""
    import dataclasses

    from nextoken.kernels import load

    target, _ = tiny_pair
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(target, max_num_seqs=4, dense_weights=False).generate(PROMPTS, params)]
    llm = LLM(target, max_num_seqs=4, dense_weights=False, speculative_method="ngram", num_speculative_tokens=3)
    spec = llm.engine.speculator
    cheap = bool(load("qmatmul").qmatmul_vectorized())
    assert llm.engine.runner.plan.cheap_verification == cheap and spec.config.adapt_length == (not cheap)
    drafted = {}
    for adapt in (True, False):
        spec.config = dataclasses.replace(spec.config, adapt_length=adapt)
        spec.reset_counts()
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == plain
        drafted[adapt] = spec.counts["drafted"]
        assert spec.counts["accepted"] < drafted[adapt]  # rejections happened
    assert drafted[False] > drafted[True]
    assert_no_leak(llm)
    eager = LLM(target, enforce_eager=True, speculative_method="ngram")  # PyTorch alone: rows are dear
    assert not eager.engine.runner.plan.cheap_verification and eager.engine.speculator.config.adapt_length


def test_limits_seeds_and_logprobs_under_speculation(tiny_pair):
    target, draft = tiny_pair
    llm = LLM(target, max_num_seqs=4, dense_weights=False, speculative_model=draft, num_speculative_tokens=4)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=2))
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 7 and len(c.logprobs) == 7 and c.finish_reason == "length"
    sampled = SamplingParams(temperature=0.8, max_tokens=30, seed=11, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sampled)]
    again = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sampled)]
    assert first == again  # a seeded request draws the same tokens again
    assert_no_leak(llm)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_stop_strings_under_speculation(tiny_pair, method):
    """A stop string met inside a run of accepted drafts ends the text where plain decoding ends it."""
    target, draft = tiny_pair
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(target, max_num_seqs=4, dense_weights=False)
    texts = [o.outputs[0].text for o in plain.generate(PROMPTS, greedy)]
    stops = [t[12:14] for t in texts if len(t) >= 14]
    assert stops
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stops)
    kw = {"speculative_model": draft} if method == "draft" else {"speculative_method": "ngram"}
    spec = LLM(target, max_num_seqs=4, dense_weights=False, num_speculative_tokens=4, **kw)
    got = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in spec.generate(PROMPTS, params)]
    assert got == [(o.outputs[0].text, o.outputs[0].finish_reason) for o in plain.generate(PROMPTS, params)]
    assert any(reason == "stop" for _, reason in got)
    assert_no_leak(spec)


def test_draft_with_another_vocabulary_is_refused(tiny_pair, smollm2_path):
    with pytest.raises(ModelLoadError, match="vocabulary"):
        LLM(tiny_pair[0], speculative_model=str(smollm2_path))


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{"speculative_model": "qwen2.5-coder-0.5b-instruct"}, {"speculative_method": "ngram"}])
def test_real_pair_greedy_text_unchanged(kw):
    """Qwen2.5-Coder-1.5B with the 0.5B draft, or with n-gram: the same greedy tokens as alone."""
    from benchmarks.speculative import prompts

    params = SamplingParams(temperature=0, max_tokens=48)
    plain = LLM("qwen2.5-coder-1.5b-instruct", max_num_seqs=2, max_model_len=1024, dense_weights=False)
    texts = prompts(plain, "code")[:2] + prompts(plain, "chat")[:1]
    expected = [o.outputs[0].token_ids for o in plain.generate(texts, params)]
    del plain
    llm = LLM("qwen2.5-coder-1.5b-instruct", max_num_seqs=2, max_model_len=1024, dense_weights=False, **kw)
    assert [o.outputs[0].token_ids for o in llm.generate(texts, params)] == expected
    assert llm.engine.stats()["spec_num_accepted_tokens"] > 0
    assert_no_leak(llm)


def test_step_log_records_each_verification(tiny_pair):
    """The inspector's view of speculation (`LLMEngine.history`, fed by each step's `StepStats`): every verification's drafts,
    acceptance and emitted tokens agree with the engine's counters and with the output itself;
    greedy target probabilities are 1 up to the first rejection and 0 there."""
    target, draft = tiny_pair
    llm = LLM(target, max_num_seqs=1, dense_weights=False, num_speculative_tokens=3, speculative_model=draft)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    records = [v for s in llm.engine.history.steps for v in s["spec"]]
    stats = llm.engine.stats()
    assert len(records) == stats["spec_num_verify_steps"] > 0
    assert sum(len(v["drafted"]) for v in records) == stats["spec_num_drafted_tokens"]
    assert sum(v["accepted"] for v in records) == stats["spec_num_accepted_tokens"]
    for v in records:
        a = v["accepted"]
        assert v["emitted"][:a] == v["drafted"][:a] and len(v["emitted"]) == a + 1
        assert v["p_target"] == [1.0] * a + ([0.0] if a < len(v["drafted"]) else [])
        assert len(v["q_draft"]) == len(v["drafted"]) and all(0 <= q <= 1 for q in v["q_draft"])
    toks = out.outputs[0].token_ids
    assert all(any(toks[i : i + len(v["emitted"])] == v["emitted"] for i in range(len(toks))) for v in records)


def test_hot_ranges_keep_the_first_ids_and_the_specials_after_them():
    from nextoken.spec_decode.draft import hot_ranges

    assert hot_ranges(151936, {151643, 151645, 151644}, 32768) == [(0, 32768), (151632, 151936)]
    assert hot_ranges(151936, {0, 1, 2}, 32768) == [(0, 32768)]  # specials among the first ids
    assert hot_ranges(49152, {0, 1, 2}, 32768) is None  # under twice the hot set: the whole head
    assert hot_ranges(151936, {151643}, 0) is None
    assert hot_ranges(275, {0, 1}, 100) == [(0, 96)]  # whole tiles of 16 rows


@pytest.mark.parametrize("quant", ["codes", "dense"])
def test_row_subset_equals_those_rows_of_the_full_layer(quant):
    """`Linear.row_subset`: the rows kept give the very numbers the full layer gives for them
    (each output row is its own dot product, on the same kernel), for codes and for a dense
    weight, from one range (a view) or two (a copy)."""
    from nextoken.kernels import KernelSet
    from nextoken.layers.linear import Linear
    from nextoken.layers.quantization.methods import CodesMethod
    from nextoken.layers.quantization.qweight import QuantWeight, gguf_codes
    from nextoken.loader.quantize import quantize_rows

    torch.manual_seed(0)
    w, x = torch.randn(96, 64), torch.randn(3, 64).bfloat16()
    layer = Linear(64, 96, False, torch.bfloat16)
    if quant == "codes":
        lib = KernelSet.resolve().qmatmul
        layer.set_qweight(QuantWeight.pack(gguf_codes(quantize_rows(w, "Q8_0"), "Q8_0", 96, 64)), CodesMethod(lib))
    else:
        layer.weight = torch.nn.Parameter(w.bfloat16(), requires_grad=False)
    full = layer(x)
    for ranges in ([(0, 32)], [(0, 32), (64, 96)]):
        sub = layer.row_subset(ranges)
        assert sub.out_features == sum(b - a for a, b in ranges)
        assert torch.equal(sub(x), torch.cat([full[:, a:b] for a, b in ranges], dim=1))


def test_a_draft_head_of_the_hot_tokens_keeps_the_output(tiny_pair):
    """With `speculative_draft_vocab` the draft's head keeps the first ids only: its logits
    elsewhere are -inf (it never proposes those tokens), it still drafts and is accepted, and the
    target's greedy output is the one it gives alone."""
    target, draft = tiny_pair
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(target, dense_weights=False).generate(PROMPTS, params)
    llm = LLM(target, dense_weights=False, speculative_model=draft, num_speculative_tokens=3,
              speculative_draft_vocab=128)
    proposer = llm.engine.speculator.draft
    assert proposer.head_ranges == [(0, 128)] and proposer.runner.model.lm_head.out_features == 128
    full = proposer._full_logits(torch.zeros(2, 128))
    assert full.shape == (2, proposer.vocab_size) and torch.isinf(full[:, 128:]).all()
    spec = llm.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.stats()["spec_num_accepted_tokens"] > 0
    assert_no_leak(llm)
