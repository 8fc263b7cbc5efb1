"""Tokenizer ids against `transformers`' tokenizer of the same GGUF (tests/data reference files)."""

from __future__ import annotations

import pytest

from nextoken.errors import InvalidRequest
from nextoken.loader.gguf import GGUFFile
from nextoken.tokenizer import Tokenizer
from nextoken.tokenizer.chat_template import render
from tests.conftest import load_reference


@pytest.fixture(scope="module")
def smol_tok(smollm2_path):
    return Tokenizer.from_gguf(GGUFFile(smollm2_path))


def test_ids_equal_reference(smol_tok):
    ref = load_reference("smollm2-135m-instruct")
    for case in ref["tokenize"]:
        assert smol_tok.encode(case["text"]) == case["ids"], case["text"]


def test_prompts_and_chat_template_equal_reference(smol_tok):
    for g in load_reference("smollm2-135m-instruct")["generations"]:
        text = smol_tok.apply_chat_template(g["prompt"]) if g["kind"] == "chat" else g["prompt"]
        assert smol_tok.encode(text) == g["prompt_ids"]


def test_decode_inverts_encode(smol_tok):
    for case in load_reference("smollm2-135m-instruct")["tokenize"]:
        assert smol_tok.decode(case["ids"]) == case["text"]


def test_special_tokens_stay_literal_when_asked(smol_tok):
    text = "<|im_start|>user\nhi<|im_end|>"
    parsed = smol_tok.encode(text)
    literal = smol_tok.encode(text, parse_special=False)
    assert parsed[0] == 1 and parsed[-1] == 2
    assert not set(literal) & smol_tok.special_ids
    assert smol_tok.decode(literal) == text
    assert smol_tok.encode(text) == parsed  # the literal switch does not stick


def test_literal_and_parsed_encodes_from_many_threads(smol_tok):
    """One tokenizer serves both ways (its special-token switch is flipped per call, under a
    lock): threads encoding both ways at once each get what a lone call gets."""
    from concurrent.futures import ThreadPoolExecutor

    texts = [f"<|im_start|>user\n{'word ' * i}<|im_end|>" for i in range(40)]
    want = [(smol_tok.encode(t), smol_tok.encode(t, parse_special=False)) for t in texts]

    def both(i):
        return smol_tok.encode(texts[i]), smol_tok.encode(texts[i], parse_special=False)

    with ThreadPoolExecutor(8) as pool:
        for _ in range(5):
            assert list(pool.map(both, range(len(texts)))) == want


def test_end_of_generation_tokens(smol_tok):
    assert smol_tok.tokens[2] == "<|im_end|>" and 2 in smol_tok.eog_token_ids


def test_chat_template_with_system_message(smol_tok):
    text = smol_tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_is_sandboxed():
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(InvalidRequest, match="chat template"):
        render(evil, [{"role": "user", "content": "x"}])


def test_a_model_without_a_chat_template_says_what_to_send_instead(smol_tok):
    """Gemma 3 270M (the base model) has none: the error names the plain-prompt routes, the
    command line's flag and the engine's option, whichever way the messages came."""
    import copy

    tok = copy.copy(smol_tok)
    tok.chat_template = None
    with pytest.raises(InvalidRequest) as e:
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert e.value.field == "messages"
    assert all(s in str(e.value) for s in ("/v1/completions", "--raw", "--chat-template"))


@pytest.mark.parametrize("messages,field", [
    ([], "messages"),
    ([{"role": "wizard", "content": "x"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0]"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
])
def test_bad_messages_name_the_field(messages, field):
    with pytest.raises(InvalidRequest) as e:
        render("{{ messages }}", messages)
    assert e.value.field == field


@pytest.mark.slow
def test_qwen2_ids_equal_reference():
    from nextoken.catalog import pull

    tok = Tokenizer.from_gguf(GGUFFile(pull("qwen2.5-coder-0.5b-instruct", progress=False)))
    ref = load_reference("qwen2.5-coder-0.5b-instruct")
    for case in ref["tokenize"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
    for g in ref["generations"]:
        text = tok.apply_chat_template(g["prompt"]) if g["kind"] == "chat" else g["prompt"]
        assert tok.encode(text) == g["prompt_ids"]
