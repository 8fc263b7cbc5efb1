"""Triton's compilations in this process after the engine said it was ready (`ready`), each
logged with its time and the specialization that caused it (`watch` installs the hooks).

Why: on the H200 (`benchmarks/gpu_check.py`, 2026-11-30) the serving run's engine process spent
about a tenth of its samples in Triton's compiler: a kernel compiles once per specialization
(its constexprs, and whether each integer argument is 1 or a multiple of 16, each pointer
16-byte aligned), and a shape the warm-up and the captured decode graphs never met compiles
while the first users wait. The log says which, so that the warm-up can meet it or the argument
stop being specialized (``do_not_specialize``).

Uses Triton's JIT hooks (``triton.knobs.runtime.jit_cache_hook``, before a compilation, and
``jit_post_compile_hook``, after); where another user holds them they are left alone.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("nextoken.kernels")

_STARTED: dict[int, float] = {}  # thread -> when its compilation began
_READY = [False]


def watch() -> bool:
    """Install the hooks (once a process); False when Triton lacks them or they are taken."""
    try:
        from triton import knobs
    except ImportError:
        return False
    rt = getattr(knobs, "runtime", None)
    if rt is None or not hasattr(rt, "jit_post_compile_hook"):
        return False
    if rt.jit_cache_hook is _before:
        return True
    if rt.jit_cache_hook is not None or rt.jit_post_compile_hook is not None:
        return False
    rt.jit_cache_hook, rt.jit_post_compile_hook = _before, _after
    return True


def ready() -> None:
    """The engine is warm: compilations from now on are logged (INFO) with what they were for."""
    _READY[0] = True


def _before(**kw) -> bool:
    _STARTED[threading.get_ident()] = time.perf_counter()
    return False  # (a true value would skip the compilation)


def _after(**kw) -> None:
    t0 = _STARTED.pop(threading.get_ident(), None)
    seconds = time.perf_counter() - t0 if t0 is not None else 0.0
    if _READY[0]:
        log.info("Triton compiled %s in %.2f s after the engine was ready: %s", getattr(kw.get("fn"), "name", "?"),
                 seconds, kw.get("repr", ""))
