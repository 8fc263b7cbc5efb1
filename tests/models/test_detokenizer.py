"""Incremental detokenization: multi-byte characters split over tokens, stop strings held back."""

from __future__ import annotations

import pytest

from nextoken.loader.gguf import GGUFFile
from nextoken.tokenizer import Tokenizer
from nextoken.tokenizer.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return Tokenizer.from_gguf(GGUFFile(smollm2_path))


def stream(tok, ids, **kw):
    d = IncrementalDetokenizer(tok, **kw)
    deltas = []
    for t in ids:
        stopped = d.add_token(t)
        deltas.append(d.emit())
        if stopped:
            break
    d.flush()
    deltas.append(d.emit(finished=True))
    return d, deltas


@pytest.mark.parametrize("text", ["日本語のテキスト", "emoji 🤖🚀 ok", "naïve café — déjà vu"])
def test_split_characters_never_print_as_garbage(tok, text):
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # several characters really are split over tokens
    _, deltas = stream(tok, ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("stop,expected", [
    (["STOP"], "Hello world. "),          # stop string is its own tokens
    (["orld"], "Hello w"),               # stop string inside one token
    ([". ST"], "Hello world"),           # stop string across token boundaries
    (["nothing", "world"], "Hello "),     # the earliest of several
])
def test_stop_strings_never_leak(tok, stop, expected):
    d, deltas = stream(tok, tok.encode("Hello world. STOP here and more"), stop=stop)
    assert "".join(deltas) == expected  # deltas are never taken back, so nothing leaked
    assert d.stop_reason is not None


def test_include_stop_string(tok):
    _, deltas = stream(tok, tok.encode("Hello world. STOP here"), stop=["STOP"], include_stop_str_in_output=True)
    assert "".join(deltas) == "Hello world. STOP"


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("hi<|im_end|>")
    assert "".join(stream(tok, ids)[1]) == "hi"
    assert "".join(stream(tok, ids, skip_special_tokens=False)[1]) == "hi<|im_end|>"


def test_unfinished_character_is_flushed_at_the_end(tok):
    ids = tok.encode("🤖")
    _, deltas = stream(tok, ids[:-1])
    assert "".join(deltas).endswith("\ufffd")
