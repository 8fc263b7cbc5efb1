"""Triton's compilations after the warm-up (`kernels.gpu.compiles`): its hooks go into Triton's
JIT and a compilation after the engine said it was ready is logged with its specialization. (Under
the interpreter nothing compiles: the hooks are called here as Triton calls them; a GPU run's
serving log shows the real ones, which benchmarks/gpu_check.py counts.)"""

from __future__ import annotations

import logging

import pytest

triton = pytest.importorskip("triton", reason="Triton is a test dependency (pyproject's test extra)")

from nextoken.kernels.gpu import compiles  # noqa: E402


def test_a_compilation_after_the_warm_up_is_logged(monkeypatch, caplog):
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(compiles, "_READY", [False])
    assert compiles.watch() and knobs.runtime.jit_cache_hook is compiles._before
    assert compiles.watch()  # (twice: still ours)

    class Fn:
        name = "_attention_kernel"

    def compile_once():  # as `JITFunction._do_compile` calls them: before (false: compile), then after
        assert knobs.runtime.jit_cache_hook(key="k", repr="_attention_kernel[...](stride_tab: i32)", fn=Fn(),
                                            compile={}, is_manual_warmup=False, already_compiled=False) is False
        knobs.runtime.jit_post_compile_hook(key="k", repr="_attention_kernel[...](stride_tab: i32)", fn=Fn(),
                                            compile={}, is_manual_warmup=False, already_compiled=False)

    with caplog.at_level(logging.INFO, logger="nextoken.kernels"):
        compile_once()
        assert not caplog.records  # (during the warm-up: expected, not logged)
        compiles.ready()
        compile_once()
    assert len(caplog.records) == 1
    assert "Triton compiled _attention_kernel in" in caplog.text and "stride_tab: i32" in caplog.text


def test_hooks_another_user_holds_are_left_alone(monkeypatch):
    from triton import knobs

    theirs = object()
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", theirs)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    assert not compiles.watch() and knobs.runtime.jit_cache_hook is theirs
