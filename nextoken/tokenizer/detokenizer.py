"""Incremental detokenization: token ids arrive one by one, text goes out as soon as it is final.

Two hazards, both handled here:
- A character can span several tokens (byte-level BPE splits UTF-8 sequences, e.g. an emoji is
  three or four byte tokens). Text is released only when its decode does not end in an
  unfinished sequence (U+FFFD), so a split character never prints as garbage.
- A stop string can span several tokens. The last ``len(longest stop) - 1`` characters are held
  back until it is clear they do not start a stop string, so a stop string never leaks into
  streamed output.

The offsets scheme (decode a short window of recent tokens, not the whole output) follows
Hugging Face's ``TextStreamer`` and vLLM's ``detokenize_incrementally``. With a `tokenizers`
tokenizer underneath, the same scheme runs in Rust (`tokenizers.decoders.DecodeStream`, which
vLLM uses too): one call per token instead of two decodes, 1.7-3.0 us a token against 2.5-4.0
(add_token and emit, warm tokenizers, SmolLM2 to Gemma 3's vocabulary). The Python window decode stays as
the reference path (tested equal) and takes over where the stream refuses a token (its decode of
the window does not extend the previous text).

With ``skip_special_tokens`` a special token never enters the window: a decode drops special
tokens before it decodes (`tokenizers`' rule), so the text is the same, while a window that took
them would never close over a run of them (a window's decode that gains no text keeps its
tokens): a model that emits its end-of-turn token again and again under ``ignore_eos`` made
each step decode the whole run, 40 us a token after 800 of them. Likewise a run of bytes that
never form a character (a model emitting one continuation byte again and again) would keep the
window's text ending in U+FFFD: from `LONG_PENDING` held-back tokens on, the window decode releases
the text before the last `SETTLED_TAIL` tokens where the whole window's text begins with it.
That text is final: with byte-level BPE (a lossy UTF-8 decode of all the bytes) the bytes that
settle it are there already; with SentencePiece's byte fallback (a run of byte tokens is its
text only when all of it is valid UTF-8, else one U+FFFD a byte), so many held-back tokens mean
an invalid byte in the run, which no later token makes valid.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
LONG_PENDING = 8  # held-back tokens after which the window's settled head is released (the docstring)
SETTLED_TAIL = 4  # the tokens kept back then: a character spans at most 4 bytes


def _decode_stream(tokenizer, skip_special_tokens: bool):
    """A `DecodeStream` over `tokenizer`'s `tokenizers.Tokenizer` (`Tokenizer.hf_tokenizer`),
    or None for a tokenizer without one."""
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is None:
        return None
    from tokenizers.decoders import DecodeStream

    return DecodeStream(skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text deltas, stopping at stop strings."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False, fast: bool = True):
        self.tokenizer = tokenizer
        self._stream = _decode_stream(tokenizer, skip_special_tokens) if fast else None
        self.skip_special_tokens = skip_special_tokens
        # the special tokens a decode drops before decoding: no text, and kept out of every window
        self._dropped = getattr(tokenizer, "special_ids", frozenset()) if skip_special_tokens else frozenset()
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # all text decoded so far (cut at a stop string when one was found)
        self.stop_reason: str | None = None  # the stop string that ended the text, if any
        self._prefix = 0  # start of the window of ids decoded for context
        self._read = 0  # ids before this are in self.text
        self._emitted = 0  # chars of self.text already handed out by `emit`

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> bool:
        """Append one token id; returns True when the text now ends at a stop string."""
        if self.stop_reason is not None:
            return True
        if token_id in self._dropped:
            return False
        self.ids.append(token_id)
        got = self._new_text(token_id)
        if got is None:
            return False  # nothing new, or an unfinished UTF-8 sequence: wait for more tokens
        delta, read = got
        self._append(delta)
        self._prefix, self._read = self._read, read
        return self.stop_reason is not None

    def _new_text(self, token_id: int) -> tuple[str, int] | None:
        """The text the window gains with `token_id` (just appended to `ids`) and the end of the
        ids it covers, or None while it gains none: the Rust stream's step, or the window decode
        (the reference, and the path from the first token the stream refuses on, or from the
        `LONG_PENDING`-th token it holds back)."""
        if self._stream is not None:
            try:
                text = self._stream.step(self.tokenizer.hf_tokenizer, token_id)
            except Exception:  # noqa: BLE001 - the stream's "invalid prefix": the window decode goes on
                self._stream = None
            else:
                if text is not None:
                    return text, len(self.ids)
                if len(self.ids) - self._read < LONG_PENDING:
                    return None
                self._stream = None  # (the stream cannot release part of what it holds)
        prev = self._decode(self.ids[self._prefix : self._read])
        new = self._decode(self.ids[self._prefix :])
        if len(new) > len(prev) and not new.endswith(REPLACEMENT):
            return new[len(prev) :], len(self.ids)
        if len(self.ids) - self._read < LONG_PENDING:
            return None
        cut = len(self.ids) - SETTLED_TAIL
        head = self._decode(self.ids[self._prefix : cut])
        if len(head) > len(prev) and head.startswith(prev) and new.startswith(head):
            return head[len(prev) :], cut
        return None

    @property
    def pending(self) -> bool:
        """Whether some tokens' text is held back (an unfinished UTF-8 sequence so far)."""
        return self._read < len(self.ids)

    def flush(self) -> None:
        """The sequence is over: take any bytes still pending, even if they are incomplete."""
        if self.stop_reason is None and self.pending:
            prev = self._decode(self.ids[self._prefix : self._read])
            self._append(self._decode(self.ids[self._prefix :])[len(prev) :])
            self._read = len(self.ids)

    def _append(self, delta: str) -> None:
        search_from = max(0, len(self.text) - self.hold)
        self.text += delta
        hit = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i >= 0 and (hit is None or i < hit[0]):
                hit = (i, s)
        if hit is not None:
            i, s = hit
            self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
            self.stop_reason = s

    def emit(self, finished: bool = False) -> str:
        """Text not yet handed out that is final (all of it when `finished` or stopped)."""
        end = len(self.text) if (finished or self.stop_reason is not None) else len(self.text) - self.hold
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta


class NoText:
    """The detokenizer of a request whose front end makes the text (`RequestOptions.detokenize`
    False; it has no stop strings): every token adds no text and stops nothing, so the engine's
    step spends nothing on text. Stateless: one instance serves every such sequence."""

    text = ""
    stop_reason = None
    pending = False

    def add_token(self, token_id: int) -> bool:
        return False

    def flush(self) -> None:
        pass

    def emit(self, finished: bool = False) -> str:
        return ""


NO_TEXT = NoText()


class FinalText:
    """The detokenizer of a sequence whose text is read only once it ends (a `final_only` request
    without stop strings: `LLM.generate`'s): it keeps the token ids `add_token` gets (as
    `IncrementalDetokenizer` gets them: the ending token never) and makes the text at the end in
    one decode (`flush`), without a decode step per token (the `DecodeStream` call and its
    bookkeeping: a decode step of 64 sequences' host work 27.8 -> 20.7 us a sequence). The whole
    decode is what the incremental deltas join to (tests), except after a run of byte tokens
    that SentencePiece's byte fallback decodes as invalid as a whole while the deltas released a
    valid pair at its start: there the whole decode is the reference. A sequence that ends
    otherwise (aborted, failed) gets the incremental detokenizer's text so far (`so_far`)."""

    stop_reason = None

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self.pending = False  # (nothing is ever held back: there is no text before the end)

    def add_token(self, token_id: int) -> bool:
        self.ids.append(token_id)
        return False

    def flush(self) -> None:
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)

    def emit(self, finished: bool = False) -> str:
        return self.text if finished else ""

    def so_far(self) -> str:
        """The text an `IncrementalDetokenizer` would have handed out by now (its held-back bytes
        kept back): a sequence's text when it ends without its last token's flush."""
        d = IncrementalDetokenizer(self.tokenizer, self.skip_special_tokens)
        for t in self.ids:
            d.add_token(t)
        return d.emit()
