"""The host's integer helpers for our Triton launches (`kernels.gpu.ints`) against Triton's own
``triton.cdiv`` and ``triton.next_power_of_2`` (which cost about 3.5 us a call from Python)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton", reason="Triton is a test dependency (pyproject's test extra)")

from nextoken.kernels.gpu.ints import cdiv, next_power_of_2  # noqa: E402


def test_cdiv_and_next_power_of_2_are_tritons():
    """Every n in 0..5000 (and the catalog's vocabularies and widths), every divisor 1..64."""
    for n in list(range(5001)) + [151_936, 262_144, 49_152, 8_960, 17_920]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for b in (1, 2, 3, 7, 16, 63, 64):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)
