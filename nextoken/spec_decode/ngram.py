"""N-gram (prompt lookup) proposals: no second model.

For the last n tokens of a sequence (n from `ngram_max` down to `ngram_min`), find their most
recent earlier occurrence in the sequence and propose the tokens that followed it. Code edits,
summaries and retrieval answers repeat much of their prompt, so the guesses are often right.
"""

from __future__ import annotations


def propose_ngram(tokens: list[int], k: int, ngram_max: int = 3, ngram_min: int = 1) -> list[int]:
    """Up to `k` tokens continuing `tokens`, or [] when no suffix of length `ngram_min` ..
    `ngram_max` occurred before. The longest matching suffix wins; among its occurrences, the
    most recent one followed by `k` tokens (so a repeating run proposes a whole period), else
    the most recent one followed by anything."""
    n_tok = len(tokens)
    if k <= 0:
        return []
    for n in range(min(ngram_max, n_tok - 1), ngram_min - 1, -1):
        suffix = tokens[n_tok - n :]
        first, fallback = suffix[0], None
        for i in range(n_tok - n - 1, -1, -1):  # i: start of an earlier occurrence
            if tokens[i] == first and tokens[i : i + n] == suffix:
                if i + n + k <= n_tok:
                    return tokens[i + n : i + n + k]
                if fallback is None:
                    fallback = i
        if fallback is not None:
            return tokens[fallback + n : fallback + n + k]
    return []
