"""The random numbers of the sampler's draws: one stream per request, with no PyTorch.

Every draw consumes one uniform number u in [0, 1) (`sample.sampler.draw`: the inverse CDF of
the kept tokens in id order). The stream is SplitMix64 (Steele, Lea & Flood 2014, "Fast
Splittable Pseudorandom Number Generators"; the generator Java's SplittableRandom and
xoshiro's seeding use): a 64-bit counter stepped by the golden-ratio increment and mixed by two
multiply-xorshift rounds. u is its top 24 bits times 2^-24, a float32 value as ``torch.rand``
gives. The module is torch-free so that the first token of ``nextoken run``
(`runner.quick_start`) draws exactly what the engine draws for the same seed.
"""

from __future__ import annotations

import os

_MASK = 0xFFFF_FFFF_FFFF_FFFF
_GOLDEN = 0x9E3779B97F4A7C15


class DrawGenerator:
    """One request's stream of uniform numbers: `seed` (any int, taken mod 2^64), or a random
    seed from the operating system when None."""

    __slots__ = ("state",)

    def __init__(self, seed: int | None = None):
        self.state = (seed if seed is not None else int.from_bytes(os.urandom(8), "little")) & _MASK

    def next_u64(self) -> int:
        self.state = (self.state + _GOLDEN) & _MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    def uniform(self) -> float:
        """The next u in [0, 1): a multiple of 2^-24."""
        return (self.next_u64() >> 40) * (1.0 / (1 << 24))

    def skip(self, n: int) -> None:
        """Pass over `n` numbers (drawn elsewhere from the same seed)."""
        self.state = (self.state + n * _GOLDEN) & _MASK
