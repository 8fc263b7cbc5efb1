"""The test processes' own set-up (tests/conftest.py's `pytest_configure`)."""

from __future__ import annotations

import os
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


def test_the_interpreter_skips_discarded_checks_and_lists_builtins_once(monkeypatch):
    """Under Triton's interpreter (tests/conftest.py's patches): an int32 sum is not also computed
    in int64 for an overflow check that is then discarded, and a launch does not list the
    language's members again; the kernel's values are those of the same sums in NumPy (int32,
    wrapping)."""
    import inspect

    import numpy as np
    import torch

    triton = pytest.importorskip("triton")
    import triton.language as tl
    from triton.runtime import interpreter

    from tests.helpers import triton_interpreter

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("not under Triton's interpreter (TRITON_INTERPRET=0)")
    assert triton_interpreter.installed  # by conftest

    @triton.jit
    def sums(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out_ptr + i, tl.load(a_ptr + i) + tl.load(b_ptr + i) * 3)

    a = torch.tensor([1, -7, 2**31 - 1, 40], dtype=torch.int32)
    b = torch.tensor([5, 2**30, 1, -9], dtype=torch.int32)
    out = torch.empty_like(a)
    sums[(1,)](a, b, out, N=4)  # (the first launch lists the members)
    casts, listings = [], []
    cast, getmembers = interpreter.interpreter_semantic.cast, inspect.getmembers
    monkeypatch.setattr(interpreter.interpreter_semantic, "cast",
                        lambda x, ty, *args, **kw: casts.append(ty) or cast(x, ty, *args, **kw))
    monkeypatch.setattr(inspect, "getmembers", lambda *args, **kw: listings.append(1) or getmembers(*args, **kw))
    sums[(1,)](a, b, out, N=4)
    assert tl.int64 not in casts and not listings
    with np.errstate(over="ignore"):
        want = a.numpy() + b.numpy() * np.int32(3)
    assert out.tolist() == want.tolist()
