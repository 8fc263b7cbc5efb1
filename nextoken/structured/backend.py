"""The grammar engine: llguidance over the model's own vocabulary.

`GrammarCompiler` (one per engine) builds llguidance's tokenizer from nextoken's `Tokenizer` the
first time a request asks for structured output, and compiles each constraint once, cached by
its text: later requests with the same schema copy the compiled matcher. Each sequence gets its
own `SequenceGrammar` (never shared across ``n > 1``), which the sampler asks for the allowed
tokens and the engine advances with every token it emits.
"""

from __future__ import annotations

import logging
import threading

from typing import TYPE_CHECKING

import numpy as np
from cachetools import LRUCache

from nextoken.errors import InvalidRequest
from nextoken.structured.params import StructuredOutputsParams, grammar_source

if TYPE_CHECKING:  # (compiling a grammar to check a request needs no PyTorch: a server over an engine process)
    import torch

log = logging.getLogger("nextoken.structured")
CACHE_SIZE = 64  # compiled grammars kept


class _Vocabulary:
    """What llguidance's ``TokenizerWrapper`` reads: each id's bytes (b"" for ids no text maps
    to, which llguidance never allows), the special ids, and an encoder (bytes -> ids)."""

    def __init__(self, tok, vocab_size: int):
        self.eos_token_id = min(tok.eog_token_ids) if tok.eog_token_ids else tok.eos_token_id
        self.bos_token_id = tok.bos_token_id
        n = len(tok.tokens)
        self.tokens = [tok.token_bytes(i) if i < n and i not in tok.unused_ids else b"" for i in range(vocab_size)]
        self.special_token_ids = sorted(i for i in tok.special_ids if i < vocab_size)
        self._tok = tok

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_bos=False, parse_special=False)


def build_ll_tokenizer(tok, vocab_size: int):
    """llguidance's ``LLTokenizer`` for nextoken tokenizer `tok` and a model with `vocab_size`
    logits (which may exceed the tokenizer's vocabulary: the extra ids are never allowed)."""
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tok, vocab_size)), n_vocab=vocab_size,
                                  eos_token=sorted(tok.eog_token_ids))


class GrammarCompiler:
    """Compiles `StructuredOutputsParams` into llguidance matchers for one model.

    Thread-safe: the server compiles in a worker thread before the request enters the engine,
    so the step loop only ever copies a cached matcher."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer = None
        self._cache: LRUCache[tuple[str, str], object] = LRUCache(CACHE_SIZE)
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = build_ll_tokenizer(self.tokenizer, self.vocab_size)
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutputsParams):
        """The compiled matcher for `spec` (from the cache when seen before). Raises
        `InvalidRequest` naming the field and llguidance's reason for an invalid schema, regex
        or grammar, or a schema feature it does not support."""
        key = spec.source()
        with self._lock:
            if key in self._cache:
                return self._cache[key]  # (a read makes it the most recently used)
        import llguidance

        grammar = grammar_source(*key)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            field = {"json": "json_schema", "regex": "guided_regex", "grammar": "guided_grammar",
                     "choice": "guided_choice", "json_object": "response_format"}[key[0]]
            raise InvalidRequest(f"{field} cannot be used: {_first_line(matcher.get_error())}", field)
        with self._lock:
            self._cache[key] = matcher
        return matcher

    def sequence_grammar(self, spec: StructuredOutputsParams) -> "SequenceGrammar":
        """A fresh matcher state for one sequence."""
        return SequenceGrammar(self.compile(spec).deep_copy(), self.vocab_size,
                               sorted(self.tokenizer.eog_token_ids))


def _first_line(message: str) -> str:
    """llguidance's error without its parser-state dump, on one line."""
    head = " ".join(message.split("\n<state>")[0].split())
    return head[:400] if head else message


class SequenceGrammar:
    """One sequence's position in its grammar. Invariant: the matcher has consumed exactly the
    sequence's output tokens (the engine calls `accept` for each token it emits); tokens ahead
    of that (drafts under verification) are consumed only for the time of one mask."""

    def __init__(self, matcher, vocab_size: int, eog_ids: list[int]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eog_ids = eog_ids

    def allowed(self, ahead: list[int] = ()) -> torch.Tensor:
        """bool ``[vocab_size]``: the tokens the grammar allows after the output so far and then
        `ahead`. When nothing is allowed (tokens ahead that break the grammar, or a matcher in an
        error state) only the end-of-generation tokens are, so the sequence ends."""
        return ~self.refused(ahead)

    def refused(self, ahead: list[int] = ()) -> torch.Tensor:
        """The complement of `allowed` (what the sampler sets to -inf), unpacked from
        llguidance's bitmask inverted, so no second pass inverts it."""
        m = self.matcher
        n = m.validate_tokens(list(ahead)) if ahead else 0
        if n < len(ahead):
            return ~self._only_eog()
        if ahead:
            m.consume_tokens(list(ahead))
        bits = m.compute_bitmask()
        if ahead:
            m.rollback(len(ahead))
        refused = np.unpackbits(np.invert(np.frombuffer(bits, dtype=np.uint8)), bitorder="little")[: self.vocab_size]
        if refused.all():
            log.warning("grammar allows no token (%s); ending the sequence", _first_line(m.get_error()) or "stopped")
            return ~self._only_eog()
        import torch

        return torch.from_numpy(refused.view(np.bool_))

    def _only_eog(self) -> torch.Tensor:
        import torch

        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        allowed[self.eog_ids] = True
        return allowed

    def forced(self) -> bool:
        """Whether the grammar forces the next bytes (a key name, a closing quote...)."""
        return bool(self.matcher.compute_ff_bytes())

    def allows(self, token: int) -> bool:
        """Whether `token` is in the mask `allowed` would compute, without computing it. Where
        the grammar forces bytes next, the mask keeps only their canonical tokenization while
        llguidance's token check accepts any split of them, so there this answers False and
        the caller computes the mask; elsewhere the two agree (tested token by token)."""
        return not self.forced() and self.matcher.validate_tokens([token]) == 1

    def accept(self, token: int) -> None:
        """Advance past an emitted token."""
        if not self.matcher.consume_token(token):
            log.warning("grammar refused emitted token %d: %s", token, _first_line(self.matcher.get_error()))

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (e.g. n-gram drafts) the grammar allows in a row from here."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    @property
    def is_complete(self) -> bool:
        """Whether the output so far is a complete match (it may still go on)."""
        return self.matcher.is_accepting()


def reference_allowed(matcher, vocab_size: int) -> torch.Tensor:
    """The plain path `SequenceGrammar.allowed` must equal: llguidance's byte-per-token logit
    bias (0 or 200), read one entry per token. For tests."""
    import torch

    bias = matcher.compute_logit_bias()
    return torch.tensor([bias[i] > 0 if i < len(bias) else False for i in range(vocab_size)])
