"""vLLM's token restrictions, `SamplingParams.allowed_token_ids` and `bad_words`, through the
engine, against `transformers`' logits of the same tiny model: a restricted greedy step picks
the highest logit among the tokens left."""

from __future__ import annotations

import pytest
import torch

from nextoken import LLM, SamplingParams
from nextoken.engine.validation import bad_words_token_ids
from nextoken.errors import InvalidRequest
from nextoken.sample.logits_processors import bad_word_blocks

PROMPT = [5, 17, 200, 33]


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    path, hf = tiny_gguf["llama"]
    return LLM(str(path), dtype="float32", max_num_seqs=8), hf


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1]


def test_allowed_token_ids_keep_greedy_and_sampled_tokens_among_them(tiny):
    llm, hf = tiny
    allowed = [7, 19, 44, 101, 150]
    got = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                               allowed_token_ids=allowed))[0].outputs[0].token_ids
    ids = list(PROMPT)
    for t in got:
        assert t == allowed[int(hf_logits(hf, ids)[allowed].argmax())]
        ids.append(t)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=16, ignore_eos=True,
                             allowed_token_ids=allowed if i % 2 == 0 else None) for i in range(4)]
    outs = [o.outputs[0].token_ids for o in llm.generate([PROMPT] * 4, params)]
    assert set(outs[0]) <= set(allowed) and set(outs[2]) <= set(allowed)
    assert not set(outs[1]) <= set(allowed)  # the request beside them is not restricted
    with pytest.raises(InvalidRequest, match="allowed_token_ids"):
        llm.generate(PROMPT, SamplingParams(allowed_token_ids=[]))
    with pytest.raises(InvalidRequest, match="allowed_token_ids"):
        llm.generate(PROMPT, SamplingParams(allowed_token_ids=[10**6]))


def test_a_bad_word_is_never_generated(tiny):
    """A one-token word of a greedy answer (among letters, `allowed_token_ids`): the answer with
    it banned is the same up to it, and there takes `transformers`' best other letter; the
    word's token never comes back."""
    llm, hf = tiny
    tok = llm.tokenizer
    letters = [tok.encode(c, add_bos=False)[0] for c in "abcdefgh"]
    greedy = dict(temperature=0, max_tokens=8, ignore_eos=True, allowed_token_ids=letters)
    plain = llm.generate(PROMPT, SamplingParams(**greedy))[0].outputs[0].token_ids
    k = plain.index(plain[3])  # (its first place)
    word = tok.decode([plain[k]])
    banned = bad_words_token_ids(tok, [word])
    assert [plain[k]] in banned
    got = llm.generate(PROMPT, SamplingParams(**greedy, bad_words=[word]))[0].outputs[0].token_ids
    assert got[:k] == plain[:k] and plain[k] not in got
    others = [t for t in letters if t != plain[k]]
    assert got[k] == others[int(hf_logits(hf, PROMPT + plain[:k])[others].argmax())]
    with pytest.raises(InvalidRequest, match="bad_words"):
        llm.generate(PROMPT, SamplingParams(bad_words=["  "]))


def test_bad_word_blocks_follow_vllms_rule():
    words = [[9], [4, 5], [1, 2, 3]]
    assert bad_word_blocks(words, []) == [9]
    assert bad_word_blocks(words, [7, 4]) == [9, 5]
    assert bad_word_blocks(words, [1, 2]) == [9, 3]
    assert bad_word_blocks(words, [2, 1]) == [9]
    assert bad_word_blocks(words, [8, 8, 8, 1], [2]) == [9, 3]  # (tokens ahead of the output: speculation)
    assert bad_word_blocks(words, [1], [2, 4]) == [9, 5]
    assert bad_word_blocks([[9]], [1, 2, 3]) == [9]


def test_the_openai_routes_take_them(tiny):
    """vLLM's extra body fields on /v1/completions and /v1/chat/completions: the same tokens as
    the Python API."""
    from tests.helpers.server import LiveServer

    llm, _ = tiny
    letters = [llm.tokenizer.encode(c, add_bos=False)[0] for c in "abcdefgh"]
    want = llm.generate(PROMPT, SamplingParams(max_tokens=6, seed=1, ignore_eos=True,
                                               allowed_token_ids=letters))[0].outputs[0].text
    srv = LiveServer(llm, "tiny")
    try:
        c = srv.client()
        out = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, seed=1,
                                   extra_body={"allowed_token_ids": letters, "ignore_eos": True})
        assert out.choices[0].text == want and set(want) <= set("abcdefgh")
        ask = dict(model="tiny", messages=[{"role": "user", "content": "the cat"}], max_tokens=6, temperature=0)
        plain = c.chat.completions.create(**ask, extra_body={"allowed_token_ids": letters, "ignore_eos": True})
        text = plain.choices[0].message.content
        banned = c.chat.completions.create(**ask, extra_body={"allowed_token_ids": letters, "ignore_eos": True,
                                                              "bad_words": [text[0]]})
        assert text[0] not in banned.choices[0].message.content
    finally:
        srv.stop()


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny):
    """vLLM's ``truncate_prompt_tokens``: the request runs on the last k prompt tokens (the same
    answer as those tokens given alone), -1 keeps what the context holds; through the API too."""
    from tests.helpers.server import LiveServer

    llm, _ = tiny
    long = list(range(3, 203))
    greedy = dict(temperature=0, max_tokens=5, ignore_eos=True)
    out = llm.generate(long, SamplingParams(**greedy, truncate_prompt_tokens=10))[0]
    assert out.prompt_token_ids == long[-10:]
    assert out.outputs[0].token_ids == llm.generate(long[-10:], SamplingParams(**greedy))[0].outputs[0].token_ids
    whole = SamplingParams(temperature=0, max_tokens=1, truncate_prompt_tokens=-1)  # (then the context check)
    with pytest.raises(InvalidRequest, match="max_tokens"):
        llm.generate(long * 2, whole)
    assert llm.generate(long * 2, SamplingParams(temperature=0, max_tokens=1, truncate_prompt_tokens=255))[0] \
        .prompt_token_ids == (long * 2)[-255:]
    with pytest.raises(InvalidRequest, match="truncate_prompt_tokens"):
        llm.generate(long, SamplingParams(truncate_prompt_tokens=0))
    srv = LiveServer(llm, "tiny")
    try:
        r = srv.client().completions.create(model="tiny", prompt=long, max_tokens=5, temperature=0,
                                            extra_body={"truncate_prompt_tokens": 10, "ignore_eos": True})
        assert r.usage.prompt_tokens == 10 and r.choices[0].text == out.outputs[0].text
    finally:
        srv.stop()
