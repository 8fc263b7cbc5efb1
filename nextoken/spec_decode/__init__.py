"""Speculative decoding: n-gram and draft proposers, exact verification."""
