"""Structured output: the grammar mask against llguidance's own per-token answers, the sampler's
masked distribution against a plain masked_fill, exact speculative verification under a mask
(chi-square), and SmolLM2's sampled output validated by `jsonschema`."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest
import torch

from nextoken import LLM, SamplingParams
from nextoken.errors import InvalidRequest
from nextoken.loader.source import load_tokenizer, open_model
from nextoken import kernels
from nextoken.sample.sampler import Sampler, SamplerRequest, draw, filter_mask, make_generator, uniform
from nextoken.spec_decode.verify import verify
from nextoken.structured import StructuredOutputsParams
from nextoken.structured.backend import GrammarCompiler, SequenceGrammar, reference_allowed
from nextoken.tokenizer.tokenizer import Tokenizer

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"enum": ["Paris", "Tokyo", "Lima"]}}, "required": ["name", "age", "city"]}
SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "tags": {
        "type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}}, "required": ["ok", "tags"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                                      "score": {"type": "integer", "minimum": 0, "maximum": 10}},
     "required": ["answer"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
]
PROMPT = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return load_tokenizer(open_model(str(smollm2_path)))


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, len(tok.tokens))


@pytest.fixture(scope="module")
def smol(smollm2_llm):
    return smollm2_llm


def _text_ids(tok, text):
    return tok.encode(text, add_bos=False, parse_special=False)


def test_mask_equals_llguidance_per_token_answers_along_a_history(tok, compiler):
    """Our bit-unpacked mask equals llguidance's byte-per-token logit bias at every step of a
    valid output, and a matcher advanced along the history equals a fresh one fed the same."""
    spec = StructuredOutputsParams(json=PERSON)
    ids = _text_ids(tok, '{"name": "Zoë", "age": 31, "city": "Lima"}')
    g = compiler.sequence_grammar(spec)
    for k, t in enumerate(ids):
        got = g.allowed()
        assert torch.equal(got, reference_allowed(g.matcher, len(tok.tokens))), k
        fresh = compiler.sequence_grammar(spec)
        for u in ids[:k]:
            fresh.accept(u)
        assert torch.equal(fresh.allowed(), got), k
        assert got[t], f"token {k} of a valid output is masked"
        assert torch.equal(g.allowed(ids[k:k + 3]), fresh.allowed(ids[k:k + 3]))  # lookahead, then rolled back
        assert torch.equal(g.allowed(), got)
        g.accept(t)
    assert g.is_complete
    end = g.allowed()
    assert set(torch.nonzero(end).flatten().tolist()) == set(tok.eog_token_ids)


def test_our_vocabulary_matches_llguidance_reading_tokenizer_json(tok, compiler):
    """The tokenizer built from our vocabulary gives llguidance's own tokenizer.json reader's
    masks (SmolLM2 has no unused or user-defined tokens, where the two may differ)."""
    theirs = llguidance.LLTokenizer(tok._tok.to_str(), n_vocab=len(tok.tokens), eos_token=sorted(tok.eog_token_ids))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(PERSON, defaults={"whitespace_flexible": False})
    ours_m = llguidance.LLMatcher(compiler.ll_tokenizer, grammar, log_level=0)
    ref_m = llguidance.LLMatcher(theirs, grammar, log_level=0)
    for t in _text_ids(tok, '{"name":"Ann é ☃","age":7,"city":"Paris"}'):
        assert ours_m.compute_bitmask() == ref_m.compute_bitmask()
        assert ours_m.consume_token(t) and ref_m.consume_token(t)


def test_unused_token_ids_are_never_allowed(tok):
    """Ids the vocabulary reserves but never uses (GGUF type 5, like Qwen's [PAD...]) and ids
    past the tokenizer's vocabulary are masked even inside a JSON string."""
    reserved = [t for t in range(1000, 1010)]
    marked = Tokenizer(tok._tok, tok.tokens, tok.special_ids, tok.bos_token_id,
                       tok.eos_token_id, False, None, tok.eog_token_ids, unused_ids=reserved)
    vocab = len(tok.tokens) + 64  # a model with more logits than the tokenizer has tokens
    g = GrammarCompiler(marked, vocab).sequence_grammar(StructuredOutputsParams(json={"type": "string"}))
    g.accept(_text_ids(tok, '"')[0])
    allowed = g.allowed()
    assert allowed.shape == (vocab,)
    assert allowed.sum() > 1000  # a string admits most of the vocabulary
    assert not allowed[reserved].any() and not allowed[len(tok.tokens):].any()
    assert not allowed[sorted(tok.special_ids)].any()


class FixedGrammar:
    """A stand-in grammar: the allowed set depends on how many tokens lie ahead."""

    def __init__(self, masks):
        self.masks = masks

    def refused(self, ahead=()):
        return ~self.masks[min(len(ahead), len(self.masks) - 1)]

    def forced(self):  # no fast path
        return True


def test_sampler_masks_after_penalties_and_before_temperature_and_filters():
    torch.manual_seed(0)
    vocab = 50
    logits = torch.randn(vocab) * 3
    allowed = torch.rand(vocab) < 0.3
    allowed[int(logits.argmax())] = False  # the unmasked favourite is not allowed
    p = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, presence_penalty=0.5, repetition_penalty=1.3)
    row = SamplerRequest(p, [1, 2], [3, 3], make_generator(0), FixedGrammar([allowed]))
    kept, probs = Sampler().distribution(logits, row)
    ref = logits.clone()  # the plain path: penalties, then masked_fill, then temperature and filters
    seen = torch.tensor([1, 2, 3])
    ref[seen] = torch.where(ref[seen] > 0, ref[seen] / 1.3, ref[seen] * 1.3)
    ref[3] -= 0.5
    ref = ref.masked_fill(~allowed, float("-inf")) / 0.7
    ref_kept = filter_mask(ref, 5, 0.9, 0.0)
    assert torch.equal(kept, ref_kept)
    torch.testing.assert_close(probs, ref.masked_fill(~ref_kept, float("-inf")).softmax(-1))
    assert probs[~allowed].sum() == 0
    greedy = SamplerRequest(SamplingParams(temperature=0), [1], [], None, FixedGrammar([allowed]))
    assert Sampler().distribution(logits, greedy)[0] == int(logits.masked_fill(~allowed, float("-inf")).argmax())


def test_speculative_verification_with_masked_drafts_samples_the_masked_target():
    """Chi-square: the first emitted token of a verification (drafts drawn from the masked draft
    distribution) follows the masked target distribution."""
    torch.manual_seed(1)
    vocab, k, trials = 8, 2, 6000
    target = torch.randn(k + 1, vocab) * 1.5
    draft_logits = torch.randn(vocab) * 1.5
    masks = [torch.tensor([1, 1, 0, 1, 0, 1, 1, 0], dtype=torch.bool), torch.tensor([0, 1, 1, 1, 1, 0, 1, 1]).bool(),
             torch.tensor([1, 0, 1, 1, 0, 1, 1, 1]).bool()]
    sampler = Sampler()
    gen = make_generator(7)
    counts = torch.zeros(vocab)
    for _ in range(trials):
        row = SamplerRequest(SamplingParams(temperature=1.0), [0], [], gen, FixedGrammar(masks))
        drafts, qs = [], []
        for j in range(k):  # the draft model's masked distributions (same hook)
            _, q = sampler.distribution(draft_logits, row, drafts)
            drafts.append(int(draw(q, uniform(gen))))
            qs.append(q)
        results, _ = verify(sampler, target, drafts, qs, row)
        counts[results[0].token] += 1
    p0 = target[0].masked_fill(~masks[0], float("-inf")).softmax(-1)
    assert counts[~masks[0]].sum() == 0
    ok = masks[0]
    from scipy import stats  # where used: it takes a second to import
    _, pvalue = stats.chisquare(counts[ok].numpy(), (p0[ok] * trials).numpy())
    assert pvalue > 1e-3, (counts, p0 * trials)


def test_ngram_drafts_are_cut_at_the_first_disallowed_token(tok, compiler):
    from nextoken.spec_decode.speculator import _grammar_prefix

    g = compiler.sequence_grammar(StructuredOutputsParams(regex=r"[0-9]{2}-[0-9]{2}"))
    r = type("R", (), {})()
    r.sampler_row = SamplerRequest(SamplingParams(), [0], [], None, g)
    digits = _text_ids(tok, "1")[0], _text_ids(tok, "-")[0], _text_ids(tok, "x")[0]
    assert _grammar_prefix(r, [digits[0], digits[0], digits[1], digits[2], digits[0]]) == [digits[0]] * 2 + [digits[1]]
    assert _grammar_prefix(r, [digits[2]]) == []


def test_invalid_and_unsupported_constraints_are_invalid_requests(compiler):
    for spec, field in [(StructuredOutputsParams(json={"type": "objekt"}), "json_schema"),
                        (StructuredOutputsParams(regex="(unclosed"), "guided_regex"),
                        (StructuredOutputsParams(grammar="start: nothing_defined"), "guided_grammar"),
                        (StructuredOutputsParams(json='{"type": "object"'), "json_schema"),
                        (StructuredOutputsParams(choice=[]), "guided_choice")]:
        with pytest.raises(InvalidRequest) as e:
            compiler.compile(spec)
        assert e.value.field == field, (spec, e.value)
    with pytest.raises(InvalidRequest, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"]).kind()
    with pytest.raises(InvalidRequest, match="ignore_eos"):
        SamplingParams(structured_outputs={"regex": "a"}, ignore_eos=True).validate()
    # compiled once: the same schema text returns the cached matcher
    spec = StructuredOutputsParams(json=PERSON)
    assert compiler.compile(spec) is compiler.compile(StructuredOutputsParams(json=json.dumps(PERSON)))


def test_sampled_outputs_validate_against_their_schemas(smol):
    """100 outputs at temperature 1 across 4 schemas, n = 4 per request: each one parses and
    validates, and ends on its own (the grammar completes before max_tokens). The n sequences
    of a request are drawn apart, not copies of one (the requests of a schema share its seed,
    so they are copies of each other): for a schema with few answers all 4 may agree by chance
    (the yes / no / maybe one gives '{"answer": "no"}' 73% of the time), not for every schema."""
    done, apart = 0, []
    for i, schema in enumerate(SCHEMAS):
        params = SamplingParams(n=4, temperature=1.0, max_tokens=120, seed=i,
                                structured_outputs=StructuredOutputsParams(json=schema))
        outs = smol.generate([PROMPT] * 7 if i % 2 else [PROMPT] * 6, params)
        apart.append(len({c.text for c in outs[0].outputs}) > 1)
        for out in outs:
            for c in out.outputs:
                assert c.finish_reason == "stop", c.text
                jsonschema.validate(json.loads(c.text), schema)
                done += 1
    assert done >= 100 and sum(apart) >= 2, apart


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_structured_output_under_speculation(smollm2_path, smol, method):
    """With n-gram and draft-model speculation: sampled outputs validate, and greedy output is
    the one without speculation."""
    kw = {"speculative_method": "ngram"} if method == "ngram" else {"speculative_model": str(smollm2_path)}
    spec_llm = LLM(str(smollm2_path), max_num_seqs=16, num_speculative_tokens=3, **kw)
    for i, schema in enumerate(SCHEMAS):
        so = StructuredOutputsParams(json=schema)
        greedy = SamplingParams(temperature=0, max_tokens=120, structured_outputs=so)
        assert [o.outputs[0].text for o in spec_llm.generate([PROMPT], greedy)] == \
            [o.outputs[0].text for o in smol.generate([PROMPT], greedy)]
        sampled = SamplingParams(n=4, temperature=1.0, max_tokens=120, seed=10 + i, structured_outputs=so)
        for out in spec_llm.generate([PROMPT] * 2, sampled):
            for c in out.outputs:
                assert c.finish_reason == "stop", c.text
                jsonschema.validate(json.loads(c.text), schema)
    assert spec_llm.engine.stats()["spec_num_drafted_tokens"] > 0


def test_regex_choice_grammar_and_length(smol):
    outs = smol.generate(["Phone:"] * 8, SamplingParams(temperature=1.0, seed=3, max_tokens=30,
                                                         structured_outputs={"regex": r"\(\d{3}\) \d{3}-\d{4}"}))
    import re

    assert all(re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", o.outputs[0].text) for o in outs)
    outs = smol.generate(["Is the sky blue?"] * 8, SamplingParams(temperature=1.0, seed=4, max_tokens=10,
                                                                  structured_outputs={"choice": ["yes", "no"]}))
    assert {o.outputs[0].text for o in outs} <= {"yes", "no"}
    gbnf = 'root ::= "(" [a-z]+ " " [a-z]+ ")"'
    out = smol.generate(["A lisp form:"], SamplingParams(temperature=0, max_tokens=30,
                                                         structured_outputs={"grammar": gbnf}))[0].outputs[0]
    assert re.fullmatch(r"\([a-z]+ [a-z]+\)", out.text), out.text
    short = smol.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3,
                                                   structured_outputs={"json": PERSON}))[0].outputs[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3


def test_sequence_grammar_allows_only_eog_after_a_refused_lookahead(compiler, tok):
    g = compiler.sequence_grammar(StructuredOutputsParams(regex="[a-c]+"))
    assert isinstance(g, SequenceGrammar)
    before = g.allowed()
    allowed = g.allowed(_text_ids(tok, "zz"))
    assert set(torch.nonzero(allowed).flatten().tolist()) == set(tok.eog_token_ids)
    assert torch.equal(g.allowed(), before) and before[_text_ids(tok, "a")[0]]  # the matcher was left untouched


def test_fast_token_check_agrees_with_the_mask(tok, compiler):
    """`SequenceGrammar.allows` (the sampler's fast path) says yes only to tokens in the mask,
    and to every token of it wherever the grammar forces no bytes."""
    vocab = len(tok.tokens)
    for spec, text in [(StructuredOutputsParams(json=PERSON), '{"name": "Bob", "age": 31, "city": "Lima"}'),
                       (StructuredOutputsParams(regex=r"[a-z]+ \d+"), "hello 42"),
                       (StructuredOutputsParams(choice=["alpha", "beta"]), "beta")]:
        g = compiler.sequence_grammar(spec)
        for t in _text_ids(tok, text):
            mask = g.allowed()
            fast = torch.tensor([g.allows(i) for i in range(vocab)])
            assert not (fast & ~mask).any()
            if not g.matcher.compute_ff_bytes():
                assert torch.equal(fast, mask)
            g.accept(t)


def test_sampler_fast_path_equals_the_masked_reference(compiler, tok):
    """Greedy: the same token as always masking. Sampled: the same distribution (chi-square on
    a grammar with few choices)."""
    logits = torch.randn(len(tok.tokens), generator=torch.Generator().manual_seed(0)) * 4
    choices = ["red", "green", "blue", "cyan", "magenta"]
    firsts = [_text_ids(tok, c)[0] for c in choices]
    logits[firsts] = logits.max() + torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])  # allowed mass about 1/2:
    logits[1000:1005] = logits.max()  # both paths are taken
    spec = StructuredOutputsParams(choice=choices)
    from scipy import stats  # where used: it takes a second to import
    for temperature, trials in ((0.0, 1), (1.0, 2000)):
        counts_fast, counts_ref = {}, {}
        gen = make_generator(1)
        params = SamplingParams(temperature=temperature)
        # the rows' grammars stay at their start: sampling reads a grammar, only emitting advances it
        fast = SamplerRequest(params, [0], [], gen, compiler.sequence_grammar(spec))
        ref_row = SamplerRequest(params, [0], [], gen, compiler.sequence_grammar(spec))
        sampler = Sampler(kernel=kernels.load("sampling"))  # the engine's draw
        kept, masked = sampler.distribution(logits, ref_row)  # the masked path's distribution, computed once
        for i in range(trials):
            token = sampler(logits[None], [fast])[0].token
            counts_fast[token] = counts_fast.get(token, 0) + 1
            ref_token = kept if masked is None else int(draw(masked, uniform(gen)))  # its draw, as keep_details
            counts_ref[ref_token] = counts_ref.get(ref_token, 0) + 1
        if temperature == 0:
            assert counts_fast == counts_ref
            continue
        keys = sorted(set(counts_fast) | set(counts_ref))
        table = [[counts_fast.get(k, 0) for k in keys], [counts_ref.get(k, 0) for k in keys]]
        assert stats.chi2_contingency(table).pvalue > 1e-3, table
