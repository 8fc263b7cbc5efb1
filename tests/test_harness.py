"""The test processes' own set-up (tests/conftest.py's `pytest_configure`)."""

from __future__ import annotations

import resource

import pytest

from nextoken.kernels.toolchain import compiler


def _down(n: int) -> int:
    return 0 if n == 0 else _down(n - 1) + 1


@pytest.mark.skipif(compiler() is None, reason="the arena cache is compiled with the C compiler")
def test_freed_stack_chunks_are_kept_for_reuse():
    """Calls 300 deep cross the frame stack's 16 KiB chunks; without the cache each return unmaps
    them and each call maps and faults them in again (10,000 page faults for 2,000 such calls
    here), with it they are reused."""
    from tests.helpers import arena_cache

    assert arena_cache.installed  # by conftest
    _down(300)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(2000):
        _down(300)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 200
