"""Speculative decoding: proposers (`ngram`, `draft`) and exact verification (`verify`)."""
