"""Incremental detokenization: multi-byte characters split over tokens, stop strings held back."""

from __future__ import annotations

import pytest

from nextoken.loader.gguf import GGUFFile
from nextoken.tokenizer import Tokenizer
from nextoken.tokenizer.detokenizer import FinalText, IncrementalDetokenizer


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


def sentencepiece_tok():
    """A small SentencePiece-style tokenizer (``▁`` spaces, a space prefix stripped by the
    decoder, byte fallback for what the vocabulary lacks, two control tokens)."""
    from nextoken.tokenizer.tokenizer import SPACE, sentencepiece_bpe

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), SPACE, *"abcdefghijklmnopqrstuvwxyz.,",
              f"{SPACE}t", "th", f"{SPACE}th", "he", f"{SPACE}the", "in", "ing", f"{SPACE}a", "an", "er", "é"]
    types = [2, 3, 3, *[6] * 256, *[1] * (len(pieces) - 259)]
    hf = sentencepiece_bpe(pieces, list(range(len(pieces))), types, add_space_prefix=True)
    return Tokenizer(hf, pieces, special_ids=[1, 2], bos_token_id=1, eos_token_id=2, add_bos=True, chat_template=None)


TEXTS = ["the thing in the garden é café 日本語 🤖🚀 ok", "  two  spaces, then\ttabs\nand lines 👍🏽 end",
         "naïve — déjà vu ☃️ 東京"]


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
@pytest.mark.parametrize("skip", [True, False])
def test_the_decode_stream_equals_the_window_decode(tok, kind, skip):
    """The Rust decode stream (the fast path) hands out the same deltas, token by token, as the
    Python window decode (the reference), with control tokens among the text, split characters
    and stop strings; both join to the whole decode."""
    t = tok if kind == "byte-level" else sentencepiece_tok()
    special = sorted(t.special_ids)[:2]
    for text in TEXTS:
        ids = t.encode(text, parse_special=False)
        ids = ids[:5] + special + ids[5:]
        for stop in ([], ["in the", "🚀"]):
            fast, want = stream(t, ids, skip_special_tokens=skip, stop=stop), \
                stream(t, ids, skip_special_tokens=skip, stop=stop, fast=False)
            assert fast[0]._stream is not None and want[0]._stream is None
            assert fast[1] == want[1], (text, stop)
            if not stop:
                assert "".join(fast[1]) == t.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_a_run_of_skipped_special_tokens_stays_out_of_the_window(tok, kind):
    """A model that emits its end-of-turn token again and again (``ignore_eos``): with
    ``skip_special_tokens`` the specials never enter the decode window (whose decode would gain no
    text and so never close over them: each step decoded the whole run), and the deltas, on both
    paths, are still the whole decode's text, a split character across the run included."""
    t = tok if kind == "byte-level" else sentencepiece_tok()
    eot = sorted(t.special_ids)[-1]
    emoji = t.encode("🤖", parse_special=False)
    assert len(emoji) > 1
    ids = t.encode("the thing", parse_special=False) + [eot] * 300 + emoji[:1] + [eot] * 50 + emoji[1:] + \
        t.encode(" in the", parse_special=False)
    fast, want = stream(t, ids), stream(t, ids, fast=False)
    assert fast[1] == want[1]
    assert "".join(fast[1]) == t.decode(ids, skip_special_tokens=True)
    assert eot not in fast[0].ids and eot not in want[0].ids
    kept = stream(t, ids, skip_special_tokens=False)
    assert "".join(kept[1]) == t.decode(ids, skip_special_tokens=False) and kept[0].ids == ids


def byte_ids(t, data: bytes) -> list[int]:
    """The byte tokens of `data`: byte-level BPE's single-byte symbols, or SentencePiece's ``<0xNN>``."""
    from nextoken.tokenizer.tokenizer import _byte_decoder

    symbol = {b: c for c, b in _byte_decoder().items()}
    index = {tok: i for i, tok in enumerate(t.tokens)}
    return [index[f"<0x{b:02X}>"] if f"<0x{b:02X}>" in index else index[symbol[b]] for b in data]


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_a_run_of_bytes_that_never_form_a_character_is_released(tok, kind):
    """A model emitting a continuation byte again and again (the tiny random models do): the
    window's text ends in U+FFFD at every step, and the window no longer grows with the run (each
    step decoded it all); the deltas of both paths are still the whole decode's text, split
    characters right after the run, and invalid bytes inside a run of byte tokens, included."""
    t = tok if kind == "byte-level" else sentencepiece_tok()
    runs = [byte_ids(t, b"\x80" * 300), byte_ids(t, "€".encode()), byte_ids(t, b"\xe2\x82" * 20),
            byte_ids(t, "日本".encode()), byte_ids(t, b"\xbf" * 9 + "é".encode())]
    ids = t.encode("the thing", parse_special=False)
    for run in runs:
        ids += run + t.encode(" in the", parse_special=False)
    fast, want = stream(t, ids), stream(t, ids, fast=False)
    assert fast[1] == want[1]
    assert "".join(fast[1]) == t.decode(ids, skip_special_tokens=True)
    assert "€" in "".join(fast[1]) and "日本" in "".join(fast[1])
    d, widest = IncrementalDetokenizer(t), 0
    for i in ids:
        d.add_token(i)
        widest = max(widest, len(d.ids) - d._prefix)
    assert widest <= 16, widest


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
@pytest.mark.parametrize("skip", [True, False])
def test_the_final_text_is_what_the_incremental_deltas_join_to(tok, kind, skip):
    """`FinalText` (`LLM.generate`'s: one decode when the sequence ends) gives the whole decode,
    which the incremental deltas join to, with specials among the text, split characters and a
    byte run that never forms a character. (Where such a run follows the lead byte of a split
    character, SentencePiece's byte fallback decodes the whole run, invalid as a whole, one U+FFFD
    a byte, while the incremental deltas had released the valid pair at its start, "À" of C3 80:
    the whole decode is the reference.) Its text so far, for a sequence that ends without its
    last token's flush (aborted, failed), is what the incremental detokenizer had handed out."""
    t = tok if kind == "byte-level" else sentencepiece_tok()
    run = byte_ids(t, b"\x80" * 12 + "€".encode())

    def final_text(ids):
        final = FinalText(t, skip)
        assert not any(final.add_token(i) for i in ids) and final.emit() == ""
        final.flush()
        return final.emit(finished=True)

    for text in TEXTS:
        words = t.encode(text, parse_special=False)
        between = words[:5] + sorted(t.special_ids)[:2] + t.encode(" x", parse_special=False) + run + words[5:]
        after_a_lead_byte = words[:5] + sorted(t.special_ids)[:2] + run + words[5:]
        assert final_text(between) == t.decode(between, skip_special_tokens=skip) \
            == "".join(stream(t, between, skip_special_tokens=skip)[1])
        assert final_text(after_a_lead_byte) == t.decode(after_a_lead_byte, skip_special_tokens=skip)
        for cut in (3, 8, len(after_a_lead_byte) // 2):  # (inside the byte run and split characters too)
            part, d = FinalText(t, skip), IncrementalDetokenizer(t, skip)
            handed = ""
            for i in after_a_lead_byte[:cut]:
                part.add_token(i)
                d.add_token(i)
                handed += d.emit()
            assert part.so_far() == handed, (text, cut)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct", "gemma-3-270m"])
def test_the_decode_stream_equals_the_window_decode_on_catalog_vocabularies(name):
    from nextoken.catalog import pull

    t = Tokenizer.from_gguf(GGUFFile(pull(name, progress=False)))
    runs = byte_ids(t, b"\x80" * 40 + b"\xe2\x82" * 20 + "€".encode() + b"\xf0\x9f" * 7 + "🤖".encode())
    for text in TEXTS:
        ids = t.encode(text, parse_special=False)
        ids = ids[:5] + sorted(t.special_ids)[:3] + runs + sorted(t.special_ids)[:1] * 20 + ids[5:]
        for skip in (True, False):
            fast = stream(t, ids, skip_special_tokens=skip)[1]
            assert fast == stream(t, ids, skip_special_tokens=skip, fast=False)[1]
            assert "".join(fast) == t.decode(ids, skip_special_tokens=skip)


def test_a_token_the_stream_refuses_falls_back_to_the_window_decode(tok):
    """Where the Rust stream raises (its "invalid prefix": the window's decode does not extend the
    previous text), the detokenizer goes on with the window decode from the same place: the text
    is still the whole decode."""
    from tokenizers.decoders import DecodeStream

    class Refusing:  # a real stream that refuses its fifth token
        def __init__(self):
            self.inner, self.calls = DecodeStream(skip_special_tokens=True), 0

        def step(self, hf, token):
            self.calls += 1
            if self.calls == 5:
                raise Exception("Invalid prefix encountered")
            return self.inner.step(hf, token)

    ids = tok.encode(TEXTS[0], parse_special=False)
    d = IncrementalDetokenizer(tok)
    d._stream = Refusing()
    deltas = []
    for t in ids:
        d.add_token(t)
        deltas.append(d.emit())
    d.flush()
    deltas.append(d.emit(finished=True))
    assert d._stream is None and "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert deltas == stream(tok, ids, fast=False)[1]
