"""The Python API end to end on the real SmolLM2 (float32 against the reference; the default
path for streams, seeds and n) and on a tiny model (context-window handling)."""

from __future__ import annotations

import pytest

from nextoken import LLM, SamplingParams
from nextoken.errors import InvalidRequest
from tests.conftest import load_reference


@pytest.fixture(scope="module")
def llm(smollm2_f32):
    return smollm2_f32


@pytest.fixture(scope="module")
def fast(smollm2_llm):
    """The default path (bf16, our kernels): for what does not depend on the numbers' path."""
    return smollm2_llm


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    return LLM(str(tiny_gguf["llama"][0]), dtype="float32")


def reference(kind: str, prompt):
    return next(g for g in load_reference("smollm2-135m-instruct")["generations"]
                if g["kind"] == kind and g["prompt"] == prompt)


def test_greedy_generation_equals_reference(llm):
    ref = reference("raw", "The capital of France is")
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=48))[0]
    c = out.outputs[0]
    assert out.prompt_token_ids == ref["prompt_ids"]
    assert c.token_ids == ref["greedy_ids"]  # ends with <|im_end|>
    assert c.finish_reason == "stop"
    assert c.text == ref["greedy_text"].replace("<|im_end|>", "")


def test_chat_equals_reference(llm):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ref = reference("chat", msgs)
    c = llm.chat(msgs, SamplingParams(temperature=0))[0].outputs[0]
    assert c.token_ids == ref["greedy_ids"] and c.text == "The capital of France is Paris."


def test_system_message_is_used(llm):
    ref = reference("chat", [{"role": "system", "content": "You are a terse assistant."},
                             {"role": "user", "content": "Name three primary colors."}])
    out = llm.chat([{"role": "user", "content": "Name three primary colors."}], SamplingParams(temperature=0),
                   system="You are a terse assistant.")[0]
    assert out.prompt_token_ids == ref["prompt_ids"] and out.outputs[0].token_ids == ref["greedy_ids"]


def test_streamed_text_equals_final_text(fast):
    p = SamplingParams(temperature=0.8, seed=11, max_tokens=40)
    chunks = list(fast.stream("Once upon a time", p))
    assert "".join(c.outputs[0].delta for c in chunks) == chunks[-1].outputs[0].text
    assert sum((c.outputs[0].delta_token_ids for c in chunks), []) == chunks[-1].outputs[0].token_ids
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert fast.generate("Once upon a time", p)[0].outputs[0].text == chunks[-1].outputs[0].text


def test_same_seed_same_text(fast):
    p = SamplingParams(temperature=1.0, seed=42, max_tokens=24)
    a, b = (fast.generate("My favourite food is", p)[0].outputs[0].token_ids for _ in range(2))
    c = fast.generate("My favourite food is", SamplingParams(temperature=1.0, seed=43, max_tokens=24))[0]
    assert a == b and c.outputs[0].token_ids != a


def test_n_completions_have_their_own_streams(fast):
    p = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12)
    out = fast.generate("I like", p)[0]
    ids = [c.token_ids for c in out.outputs]
    assert len(ids) == 3 and len({tuple(x) for x in ids}) == 3
    assert [c.token_ids for c in fast.generate("I like", p)[0].outputs] == ids


def test_stop_string_and_max_tokens(llm):
    c = llm.generate("The capital of France is", SamplingParams(temperature=0, stop=["."]))[0].outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (" Paris", "stop", ".")
    c = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert len(c.token_ids) == 3 and c.finish_reason == "length"


def test_logprobs_on_request(llm):
    ref = reference("raw", "The capital of France is")
    c = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4, logprobs=5))[0].outputs[0]
    for pos, step in zip(c.logprobs, ref["steps"]):
        for tid, lp in step["top5"]:
            assert abs(pos[tid] - lp) < 1e-2
    assert abs(c.cumulative_logprob - sum(p[t] for p, t in zip(c.logprobs, c.token_ids))) < 1e-6


def test_context_window_is_enforced(tiny):
    ctx = tiny.config.context_length  # 256
    prompt = " the cat sat on the mat" * 60  # well over 256 tokens
    with pytest.raises(InvalidRequest) as e:
        tiny.generate(prompt, SamplingParams(max_tokens=10))
    n = len(tiny.tokenizer.encode(prompt))
    assert str(n) in str(e.value) and str(ctx) in str(e.value) and e.value.field == "max_tokens"
    out = tiny.generate(prompt, SamplingParams(max_tokens=10, temperature=0), truncate_prompt=True)[0]
    assert out.prompt_token_ids == tiny.tokenizer.encode(prompt)[-(ctx - 10):]
    assert len(out.outputs[0].token_ids) <= 10


def test_max_model_len_caps_the_context_and_the_default_kv_cache(tiny):
    from nextoken.llm import LLM

    small = LLM(str(tiny.model_path), dtype="float32", max_num_seqs=1, max_model_len=64)
    assert small.engine.max_model_len == 64
    # one sequence of 64 tokens: 4 blocks of 16, not the 16 blocks of the full 256-token context
    assert small.engine.kv.pool.num_blocks == 4
    with pytest.raises(InvalidRequest, match="70 > the context length 64 .max_model_len."):
        small.generate([1] * 60, SamplingParams(max_tokens=10))
    out = small.generate([5, 6, 7], SamplingParams(max_tokens=61, temperature=0, ignore_eos=True))[0]  # fills 4 blocks
    assert len(out.outputs[0].token_ids) == 61 and out.outputs[0].finish_reason == "length"


def test_bad_prompts(tiny):
    with pytest.raises(InvalidRequest, match="empty"):
        tiny.generate("", SamplingParams())
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        tiny.generate([[1, 2, 99999]], SamplingParams())
    with pytest.raises(InvalidRequest, match="token id -1 is outside the vocabulary"):
        tiny.generate([[1, -1, 2]], SamplingParams())
    for odd in ([1, True, 2], [1, 2.0], [1, None]):  # (a bool is an int to Python, not a token id)
        with pytest.raises(InvalidRequest, match="a string or a list of token ids"):
            tiny.generate([odd], SamplingParams())
    with pytest.raises(InvalidRequest) as e:
        tiny.generate("hi", SamplingParams(top_p=2))
    assert e.value.field == "top_p"


def test_token_id_prompts(tiny):
    ids = tiny.tokenizer.encode("the cat")
    a = tiny.generate([ids], SamplingParams(temperature=0, max_tokens=5))[0]
    b = tiny.generate("the cat", SamplingParams(temperature=0, max_tokens=5))[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.prompt is None


def test_vllm_prompt_dictionaries(tiny):
    """vLLM's offline prompt forms run unchanged and equal the plain ones."""
    greedy = SamplingParams(temperature=0, max_tokens=5)
    ids = tiny.tokenizer.encode("the cat sat")
    plain = [o.outputs[0].token_ids for o in tiny.generate(["the cat sat", ids], greedy)]
    dicts = [o.outputs[0].token_ids for o in tiny.generate([{"prompt": "the cat sat"}, {"prompt_token_ids": ids}],
                                                            greedy)]
    assert dicts == plain
    assert tiny.generate({"prompt_token_ids": ids}, greedy)[0].outputs[0].token_ids == plain[1]
    with pytest.raises(InvalidRequest, match="prompt_token_ids"):
        tiny.generate([{"text": "the cat"}], greedy)


def test_a_seeded_request_gives_the_same_text_alone_and_in_a_mixed_batch(tiny_gguf):
    """The engine's batched sampler draws each row from its own generator: a seeded request's
    tokens do not depend on the 31 other requests (greedy, filtered, penalized) beside it."""
    llm = LLM(str(tiny_gguf["llama"][0]), max_num_seqs=32)
    target = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, repetition_penalty=1.1, seed=11, max_tokens=20,
                            ignore_eos=True)
    alone = llm.generate([[5, 17, 200, 33]], target)[0].outputs[0].token_ids
    mixes = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
             SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
             SamplingParams(temperature=0.7, top_p=0.9, presence_penalty=0.5, max_tokens=20, ignore_eos=True, seed=3),
             SamplingParams(temperature=1.2, min_p=0.05, logit_bias={7: 3.0}, max_tokens=20, ignore_eos=True)]
    prompts = [[5, 17, 200, 33]] + [[(i * 37) % 250 + 3, 9, i + 4] for i in range(31)]
    params = [target] + [mixes[i % 4] for i in range(31)]
    outs = llm.generate(prompts, params)
    assert outs[0].outputs[0].token_ids == alone
    assert llm.generate([[5, 17, 200, 33]], SamplingParams(**{**target.__dict__, "seed": 12}))[0] \
        .outputs[0].token_ids != alone


def test_the_engine_seed_makes_unseeded_requests_repeat_in_a_fresh_engine(tiny_gguf):
    """``LLM(seed=...)`` (vLLM's ``--seed``): a fresh engine given the same unseeded requests in
    the same order samples the same tokens, another seed other tokens, and a request's own seed
    wins over the engine's. Without it the same requests differ between engines."""
    path = str(tiny_gguf["llama"][0])
    prompts = [[5, 17, 200, 33], [9, 4, 8], [5, 17, 200, 33]]
    free = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    own = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7)

    def run(**kw):
        llm = LLM(path, dtype="float32", **kw)
        first = [o.outputs[0].token_ids for o in llm.generate(prompts, free)]
        later = llm.generate(prompts[:1], free)[0].outputs[0].token_ids  # the stream goes on
        return first, later, llm.generate(prompts[:1], own)[0].outputs[0].token_ids

    a, b, c, d = run(seed=0), run(seed=0), run(seed=1), run()
    assert a == b
    assert a[0][0] != a[0][2] and a[1] != a[0][0]  # each request its own seed, the same prompt too
    assert c[0] != a[0] and d[0] != a[0]
    assert a[2] == c[2] == d[2] == LLM(path, dtype="float32").generate(prompts[:1], own)[0].outputs[0].token_ids


def test_vllm_keywords_of_generate_and_chat(tiny_gguf, capsys):
    """vLLM's `LLM.generate` / `LLM.chat` keywords: ``sampling_params=``, ``use_tqdm`` (a bar of
    the prompts done), and on chat ``chat_template``, ``chat_template_kwargs``, ``tools``,
    ``add_generation_prompt`` and ``continue_final_message`` (the answer goes on from the last
    message: its prompt is the rendered text up to that message's content, as Hugging Face's
    template renderer gives it)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32")
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = llm.generate("the cat", greedy)[0].outputs[0].token_ids
    assert llm.generate("the cat", sampling_params=greedy, use_tqdm=True)[0].outputs[0].token_ids == want
    assert "Processed prompts: 100%" in capsys.readouterr().err
    assert llm.generate("the cat", sampling_params=greedy, use_tqdm=False)[0].outputs[0].token_ids == want
    long = list(range(3, 23))  # 20 tokens: one full block of 16 cached by the first request
    assert [llm.generate(long, greedy)[0].num_cached_tokens for _ in range(2)] == [0, 16]

    convo = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on"}]
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}" \
               "{% if add_generation_prompt %}<assistant>{% endif %}{% if shout %}!{% endif %}"
    prompt_of = lambda **kw: llm.chat(convo, greedy, chat_template=template, **kw)[0].prompt  # noqa: E731
    assert prompt_of() == "<user>the cat</user><assistant>sat on</assistant><assistant>"
    assert prompt_of(chat_template_kwargs={"shout": True}).endswith("<assistant>!")
    assert prompt_of(add_generation_prompt=False, continue_final_message=True) == render_jinja_template(
        [convo], chat_template=template, continue_final_message=True)[0][0] == "<user>the cat</user><assistant>sat on"
    continued = llm.chat(convo, greedy, chat_template=template, add_generation_prompt=False,
                         continue_final_message=True)[0].outputs[0].token_ids
    assert continued == llm.generate("<user>the cat</user><assistant>sat on", greedy)[0].outputs[0].token_ids
    with pytest.raises(InvalidRequest, match="add_generation_prompt off"):
        llm.chat(convo, greedy, chat_template=template, continue_final_message=True)
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    listed = "{% for t in tools %}[{{ t['function']['name'] }}]{% endfor %}{{ messages[0]['content'] }}"
    assert llm.chat(convo[:1], greedy, chat_template=listed, tools=tools)[0].prompt == "[now]the cat"
    assert llm.chat(convo[:1], greedy)[0].prompt.startswith("<|im_start|>")


def test_get_tokenizer_answers_as_the_transformers_tokenizer(fast):
    """vLLM's ``llm.get_tokenizer()`` as scripts use it, against the ids and texts `transformers`'
    tokenizer gave for the reference generations: chat prompts rendered as ids and as text (the
    text then generated from, as such a script does), raw prompts encoded, answers decoded."""
    tok = fast.get_tokenizer()
    gens = load_reference("smollm2-135m-instruct")["generations"]
    greedy = SamplingParams(temperature=0, max_tokens=1)
    for g in gens:
        if g["kind"] == "chat":
            assert tok.apply_chat_template(g["prompt"], add_generation_prompt=True) == g["prompt_ids"]
            text = tok.apply_chat_template(g["prompt"], tokenize=False, add_generation_prompt=True)
            assert fast.generate(text, greedy)[0].prompt_token_ids == g["prompt_ids"]
        else:
            assert tok.encode(g["prompt"]) == tok(g["prompt"]).input_ids == tok([g["prompt"]])["input_ids"][0] \
                == g["prompt_ids"]
        assert tok.decode(g["greedy_ids"], skip_special_tokens=True) == g["greedy_text"].replace("<|im_end|>", "")
    ids = gens[0]["prompt_ids"]
    assert tok.convert_tokens_to_ids(tok.convert_ids_to_tokens(ids)) == ids
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert len(tok) == tok.vocab_size == fast.config.vocab_size
    with pytest.raises(InvalidRequest, match="return_tensors"):
        tok.apply_chat_template(gens[0]["prompt"], return_tensors="pt")


def test_logprobs_read_as_vllms(fast):
    """`LLM`'s logprobs dicts hold vLLM's ``Logprob`` (``.logprob``, ``.rank``,
    ``.decoded_token``), each still the float itself: the chosen token's log-probability, the
    alternatives ranked 1..k by probability, their text the tokenizer's."""
    out = fast.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4, logprobs=3,
                                                                  prompt_logprobs=2))[0]
    c = out.outputs[0]
    assert sum(step[t].logprob for step, t in zip(c.logprobs, c.token_ids)) == pytest.approx(c.cumulative_logprob)
    for step, t in zip(c.logprobs, c.token_ids):
        assert step[t].rank == 1 and step[t].decoded_token == fast.tokenizer.token_text(t)  # (greedy: the best)
        others = sorted((v for v in step.values()), key=lambda v: v.rank)
        assert [v.rank for v in others] == [1, 2, 3] and others == sorted(step.values(), reverse=True)
        assert isinstance(step[t], float) and step[t] - float(step[t]) == 0
    assert out.prompt_logprobs[0] is None
    for p, step in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert step[p].decoded_token == fast.tokenizer.token_text(p) and step[p].rank in (1, 2, None)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_reset_prefix_cache_forgets_the_cached_prompts(tiny_gguf, arch):
    """vLLM's ``LLM.reset_prefix_cache``: a prompt computed before is a prefix-cache hit, after a
    reset it is computed in full again (the same tokens); with a request unfinished the reset is
    refused and the cache still serves (Gemma 3: the sliding-window layers' pool too)."""
    llm = LLM(str(tiny_gguf[arch][0]), dtype="float32")
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = list(range(3, 40))
    first, again = (llm.generate(prompt, greedy)[0] for _ in range(2))
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)
    assert llm.reset_prefix_cache()
    cold = llm.generate(prompt, greedy)[0]
    assert cold.num_cached_tokens == 0 and cold.outputs[0].token_ids == first.outputs[0].token_ids
    llm.engine.add_request(prompt, greedy, "unfinished")
    llm.engine.step()
    assert not llm.reset_prefix_cache()
    llm.engine.abort_request("unfinished")
    assert llm.generate(prompt, greedy)[0].num_cached_tokens == 32
    llm.close()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_cache_salt_shares_prefix_blocks_only_within_a_salt(tiny_gguf, arch, tmp_path):
    """vLLM's ``cache_salt`` (a prompt dictionary's key): a prompt salted "a" finds nothing of
    the same prompt computed unsalted or salted "b", and finds its own salt's blocks; every answer
    is the same tokens, which `transformers` computes for the prompt (no cache). On a disk tier
    (a restart: RAM empty) the salted blocks are read back only for their salt. A bad salt is
    refused naming it (Gemma 3: the sliding-window layers' pool too)."""
    import torch

    from nextoken.errors import InvalidRequest

    path, hf = tiny_gguf[arch]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = list(range(3, 40))  # two full blocks of 16 cached
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt):].tolist()

    def run(llm, salt):
        out = llm.generate({"prompt_token_ids": prompt, **({"cache_salt": salt} if salt else {})}, greedy)[0]
        assert out.outputs[0].token_ids == want, salt
        return out.num_cached_tokens

    llm = LLM(str(path), dtype="float32", kv_cache_dir=str(tmp_path))
    assert [run(llm, s) for s in (None, "a", "b", "a", None, "b")] == [0, 0, 0, 32, 32, 32]
    with pytest.raises(InvalidRequest, match="cache_salt"):
        llm.generate({"prompt_token_ids": prompt, "cache_salt": ""}, greedy)
    llm.close()
    again = LLM(str(path), dtype="float32", kv_cache_dir=str(tmp_path))  # RAM empty: from the disk tier
    assert [run(again, s) for s in ("c", "a", None)] == [0, 32, 32]
    again.close()
