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


def _chain_kernel():
    """A kernel that calls a device function three times (a device function is looked up in
    its module's globals: both are defined here)."""
    global _twice, _chain
    import triton
    import triton.language as tl

    @triton.jit
    def _twice(x):
        return x * 2

    @triton.jit
    def _chain(a_ptr, out_ptr, N: tl.constexpr):
        i = tl.program_id(0) * N + tl.arange(0, N)
        x = tl.load(a_ptr + i)
        for _ in range(3):
            x = _twice(x) + 1
        tl.store(out_ptr + i, x)

    return _chain


def test_a_device_functions_call_does_not_patch_the_language_again(monkeypatch):
    """Under the interpreter, a kernel that calls a ``@triton.jit`` function three times a program
    over two programs patches ``triton.language`` once (its launch's patch), and its values are
    those of NumPy; after the launch the language is restored (a second launch patches once
    again)."""
    import numpy as np
    import torch

    triton = pytest.importorskip("triton")
    import triton.language as tl
    from triton.runtime import interpreter

    from tests.helpers import triton_interpreter

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("not under Triton's interpreter (TRITON_INTERPRET=0)")
    assert triton_interpreter.installed

    chain = _chain_kernel()
    patches = []
    core = interpreter._patch_lang_core
    monkeypatch.setattr(interpreter, "_patch_lang_core", lambda *a: patches.append(1) or core(*a))
    a = torch.arange(8, dtype=torch.float32)
    out = torch.empty_like(a)
    for launch in (1, 2):
        chain[(2,)](a, out, N=4)
        assert len(patches) == launch
        assert not hasattr(tl.tensor, "__index__")  # (the interpreter's patch, restored)
    want = a.numpy()
    for _ in range(3):
        want = want * 2 + 1
    assert np.array_equal(out.numpy(), want)


def test_bf16_casts_by_their_bits_equal_the_interpreters_routine():
    """The interpreter's bf16 <-> float32 casts taken by their bits (tests/helpers/
    triton_interpreter.py) against its own general routine, over every bf16 and 2^20 float32
    values (random bits, and the cases at the edges: zeros, infinities, NaNs, subnormals, which
    the routine keeps, and mantissas whose rounding carries into the exponent), truncating and
    rounding. (Every float32 was compared once, 2026-12-01: 7 minutes.)"""
    import numpy as np

    pytest.importorskip("triton")
    import triton.language as tl
    from triton.runtime import interpreter

    from tests.helpers import triton_interpreter

    if not triton_interpreter.installed:
        pytest.skip("the interpreter's patches are not installed here")
    fast = interpreter._convert_float
    general = fast.general
    every_bf16 = np.arange(1 << 16, dtype=np.uint16)
    assert np.array_equal(fast(every_bf16, tl.bfloat16, tl.float32, None),
                          general(every_bf16, tl.bfloat16, tl.float32, None))
    bits = np.random.default_rng(0).integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0, 1 << 31, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0x00000001, 0x807FFFFF,
                      0x3F7FFFFF, 0x3F7F8000, 0x7F7FFFFF, 0x00800000, 0x3F808000, 0x3F818000], dtype=np.uint32)
    for values in (bits, edges, np.concatenate([bits[:5], edges[6:7]])):  # (the last: one subnormal)
        x = values.view(np.float32)
        for mode in (None, interpreter._ir.ROUNDING_MODE.RTNE):
            got, want = fast(x, tl.float32, tl.bfloat16, mode), general(x, tl.float32, tl.bfloat16, mode)
            assert got.dtype == want.dtype and np.array_equal(got, want)


def test_shared_shapes_build_the_types_and_tensors_triton_builds():
    """Block types and tensors built from one record per shape (tests/helpers/triton_interpreter.py)
    have the attributes, attribute types and texts of Triton's own constructors, first and later
    times alike, each with a language tuple of its own; shapes Triton refuses stay refused with its
    error, the others it takes are built as it builds them."""
    pytest.importorskip("triton")
    import triton.language.core as core

    if not getattr(core.block_type.__init__, "original", None):
        pytest.skip("another Triton's constructors (tests/helpers/triton_interpreter.py): not replaced")

    def built(cls, init, *args):
        obj = object.__new__(cls)
        init(obj, *args)
        return obj

    def seen(obj) -> dict:
        return {k: (type(v), str(v)) for k, v in vars(obj).items()}

    fast_block, fast_tensor = core.block_type.__init__, core.tensor.__init__
    for _ in range(2):  # (the first time makes the record, the second reads it)
        for dtype, shape in ((core.float32, [4, 8]), (core.bfloat16, core.tuple([16])), (core.int32, [1, 2, 64])):
            want = built(core.block_type, fast_block.original, dtype, shape)
            got, again = (built(core.block_type, fast_block, dtype, shape) for _ in range(2))
            assert seen(got) == seen(again) == seen(want) and got == want and got.shape is not again.shape
            for ty in (got, dtype):
                t_want = built(core.tensor, fast_tensor.original, "h", ty)
                t_got, t_again = (built(core.tensor, fast_tensor, "h", ty) for _ in range(2))
                assert seen(t_got) == seen(t_again) == seen(t_want) and t_got.shape is not t_again.shape
    for odd in ([3], [0], (4,), []):  # (Triton 3.9 refuses each; 3.6 takes [3] and [0])
        try:
            want = built(core.block_type, fast_block.original, core.float32, odd)
        except Exception as refused:
            with pytest.raises(type(refused)):
                core.block_type(core.float32, odd)
        else:
            assert seen(core.block_type(core.float32, odd)) == seen(want)
