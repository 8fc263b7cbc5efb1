"""The reasoning parser (`nextoken.server.chat.reasoning`): scripted texts split at every point give
the events of the whole, for both styles; and through a live server, a tiny model whose output a
grammar holds to ``<think>...</think>answer`` comes back split on every API."""

from __future__ import annotations

import itertools

import httpx

import pytest

from nextoken.server.chat.events import Text, Thought
from nextoken.server.chat.reasoning import ReasoningParser, split

CASES = [  # (text, style, thought, answer)
    ("<think>Let me see. 2+2=4.</think>\n\nThe answer is 4.", "qwen3", "Let me see. 2+2=4.", "The answer is 4."),
    ("The answer is 4.", "qwen3", "", "The answer is 4."),
    ("  <think>a < b</think>c", "qwen3", "a < b", "c"),
    ("<think>unfinished thought", "qwen3", "unfinished thought", ""),
    ("Let me see.</think>\n4", "deepseek_r1", "Let me see.", "4"),
    ("<think>x</think>y", "deepseek_r1", "x", "y"),
    ("no end tag at all", "deepseek_r1", "no end tag at all", ""),
    ("<thin", "qwen3", "", "<thin"),
]


@pytest.mark.parametrize("text,style,thought,answer", CASES)
def test_every_split_gives_the_events_of_the_whole(text, style, thought, answer):
    assert split(text, style) == (thought, answer)
    for a, b in itertools.combinations(range(len(text) + 1), 2):  # every split into three pieces
        p = ReasoningParser(style)
        events = p.feed(text[:a]) + p.feed(text[a:b]) + p.feed(text[b:]) + p.finish()
        assert "".join(e.text for e in events if isinstance(e, Thought)) == thought, (a, b)
        assert "".join(e.text for e in events if isinstance(e, Text)) == answer, (a, b)


def test_unknown_style_is_refused_and_the_flag_offers_every_style():
    from nextoken.server import args
    from nextoken.server.chat import reasoning

    with pytest.raises(ValueError, match="qwen3"):
        ReasoningParser("other")
    assert args.PARSERS == reasoning.PARSERS  # --reasoning-parser's choices (args.py restates them)


# -- through the server --------------------------------------------------------------------------
THINKING = r"<think>[a-z ]{8,40}</think>[A-Z][a-z ]{3,30}\."  # what a thinking model writes


@pytest.fixture(scope="module")
def qwen_style(smollm2_path):
    from nextoken import LLM
    from tests.helpers.server import LiveServer

    s = LiveServer(LLM(str(smollm2_path), max_num_seqs=4), "smollm2", reasoning_parser="qwen3")
    yield s
    s.stop()


def test_chat_splits_thought_from_answer_streamed_or_not(qwen_style):
    """A real output held by a grammar to ``<think>...</think>Answer.``: the message's
    reasoning_content is the thought and content the answer, and the stream's deltas join to
    the same two."""
    import re

    kw = dict(model="smollm2", messages=[{"role": "user", "content": "Think, then answer: what is 2+2?"}],
              temperature=0, max_tokens=60, extra_body={"guided_regex": THINKING})
    c = qwen_style.client()
    r = c.chat.completions.create(**kw)
    msg = r.choices[0].message.model_dump()
    assert re.fullmatch(r"[a-z ]{8,40}", msg["reasoning_content"]) and msg["reasoning"] == msg["reasoning_content"]
    assert re.fullmatch(r"[A-Z][a-z ]{3,30}\.", msg["content"])
    chunks = list(c.chat.completions.create(stream=True, **kw))
    deltas = [ch.choices[0].delta.model_dump() for ch in chunks if ch.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
    first_answer = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(not d.get("reasoning_content") for d in deltas[first_answer:])  # the thought comes first


@pytest.fixture(scope="module")
def r1_style(tiny_gguf):
    """The DeepSeek-R1 style on a tiny model: its template opens the thought, so its whole
    (short, never closed) output is thought on every API."""
    from nextoken import LLM
    from tests.helpers.server import LiveServer

    s = LiveServer(LLM(str(tiny_gguf["llama"][0]), dtype="float32"), "tiny", reasoning_parser="deepseek_r1")
    yield s
    s.stop()


def test_every_api_carries_the_thought(r1_style):
    import anthropic
    import ollama

    ask = [{"role": "user", "content": "the cat"}]
    chat = r1_style.client().chat.completions.create(model="tiny", messages=ask, temperature=0, max_tokens=6)
    thought = chat.choices[0].message.model_dump()["reasoning_content"]
    assert thought and not chat.choices[0].message.content
    msg = anthropic.Anthropic(base_url=r1_style.url, api_key="x", max_retries=0).messages.create(
        model="tiny", max_tokens=6, messages=ask, extra_body={"temperature": 0})
    assert [b.type for b in msg.content] == ["thinking"] and msg.content[0].thinking == thought
    with anthropic.Anthropic(base_url=r1_style.url, api_key="x", max_retries=0).messages.stream(
            model="tiny", max_tokens=6, messages=ask, extra_body={"temperature": 0}) as stream:
        assert stream.get_final_message().content[0].thinking == thought
    resp = r1_style.client().responses.create(model="tiny", input="the cat", temperature=0, max_output_tokens=6)
    assert resp.output[0].type == "reasoning" and resp.output[0].content[0].text == thought
    events = list(r1_style.client().responses.create(model="tiny", input="the cat", temperature=0,
                                                     max_output_tokens=6, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    oc = ollama.Client(host=r1_style.url)
    assert oc.chat(model="tiny", messages=ask, options={"temperature": 0, "num_predict": 6}).message.thinking == thought
    assert "".join(p.message.thinking or "" for p in oc.chat(model="tiny", messages=ask, stream=True,
                                                              options={"temperature": 0, "num_predict": 6})) == thought


def test_chat_template_kwargs_reach_the_template(r1_style):
    """A template variable from the request (enable_thinking, as Qwen3's templates read it); the
    renderer's own names cannot be set."""
    base = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    ok = httpx.post(f"{r1_style.url}/v1/chat/completions", json={**base, "chat_template_kwargs":
                                                                 {"enable_thinking": False}})
    assert ok.status_code == 200
    bad = httpx.post(f"{r1_style.url}/v1/chat/completions", json={**base, "chat_template_kwargs": {"messages": []}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
