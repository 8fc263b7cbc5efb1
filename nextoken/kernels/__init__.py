"""Our C kernels, compiled on first use with the system's C compiler.

Each kernel is one ``.c`` file next to this module. `load` compiles it once per source and CPU
(``-O3 -march=native -fopenmp``) into ``<cache>/kernels/`` (see `nextoken.catalog.cache_dir`)
and opens it with ctypes; a kernel whose source another kernel includes (``qmatmul.c``,
``paged_attention.c`` and ``activation.c`` are in ``decode.c``) is served by the including
library (`host`), so its code is compiled once, not twice (``qmatmul.c`` alone takes 20 s; its
loop functions compile as four more units at once: `toolchain.SPLIT_UNITS`), and one copy of it
runs. Concurrent builds of one library (two processes starting) wait on a lock
file: one compiles, the others open its result. ``NEXTOKEN_KERNEL_ISA`` builds for an older
instruction set than the CPU's instead (`ISAS`: ``avx2`` runs the AVX2 loops an AMD Zen 3 runs,
on any CPU that has AVX2), so every loop can be run, measured and tested on one machine. Every
caller keeps a PyTorch path: when no compiler is found, the build fails, or
``NEXTOKEN_NATIVE_KERNELS=0`` is set, `load` returns None and the caller uses that path. Which kernels a model runs is decided
once, at load, by the execution plan (`nextoken.runner.plan`); ``enforce_eager`` makes that plan
PyTorch alone, which is what the reference tests compare against. OpenMP: the library asks for
``libgomp.so.1``, the runtime PyTorch has already loaded, so both share one thread pool (no
oversubscription).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field, fields

from nextoken.kernels.abi import declare
from nextoken.kernels.toolchain import build, host, library_path
from nextoken.kernels.cpu import FLAGS, ISAS, PORTABLE_FLAGS, bf16_matmul_native, cpu_runs, default_isa, isa_flags, \
    native_allowed

log = logging.getLogger(__name__)
_loaded: dict[tuple[str, str], ctypes.CDLL | None] = {}

def _open(name: str, flags: list[str]) -> ctypes.CDLL | None:
    """Build (or find) and open kernel `name`; a cached library that cannot be opened (damaged,
    or built elsewhere) is rebuilt once; after that, one warning and None."""
    path = build(name, flags)
    for attempt in range(2):
        if path is None:
            return None
        try:
            return declare(ctypes.CDLL(str(path)))
        except OSError as exc:
            if attempt == 0:
                log.warning("could not open %s (%s); building it again", path, exc)
                path = build(name, flags, force=True)
            else:
                log.warning("could not open %s (%s); using the PyTorch path", path, exc)
    return None


def _warn_if_slow(lib: ctypes.CDLL) -> None:
    """One info line when the quantized matmul was built without AVX-512 VNNI (an older CPU): it
    then runs its AVX2 or plain C loops, several times slower than on a CPU that has VNNI. Info, not a
    warning: the user cannot act on it, and the execution plan's line names it too."""
    if hasattr(lib, "qmatmul_vectorized") and not lib.qmatmul_vectorized():
        log.info("this CPU has no AVX-512 VNNI: the quantized matmul (kernels/qmatmul.c) runs its AVX2 loop "
                 "(or, without AVX2, its portable C loop), several times slower than with VNNI")


def load(name: str, portable: bool = False, isa: str | None = None) -> ctypes.CDLL | None:
    """The compiled kernel library that serves `name` (``nextoken/kernels/<name>.c``, or the
    kernel that includes it: `host`), or None (then the caller runs PyTorch). The model's layers
    never call it: they hold the handles the execution plan resolved once (`KernelSet`).
    `portable` builds it for any x86-64 CPU (no AVX-512: the kernels' plain C loops), `isa` for
    a named instruction set (`ISAS`; default `default_isa`), for the tests that hold every loop
    equal to the plain ones. Never raises for a build or load
    failure: it warns once and returns None; raises ValueError for an unknown `isa`."""
    if not native_allowed():
        return None
    isa = "portable" if portable else (isa or default_isa())
    key = (host(name), isa)
    if key not in _loaded:
        lib = _open(key[0], isa_flags(isa))
        if lib is not None and isa != "portable":
            _warn_if_slow(lib)
        _loaded[key] = lib
    return _loaded[key]


@dataclass(frozen=True)
class KernelSet:
    """The kernel libraries a model runs, resolved once by the execution plan
    (`nextoken.runner.plan`) and handed to the layers, which hold them: None means that part runs
    PyTorch. Nothing reads the environment or builds a kernel while the model runs."""

    qmatmul: ctypes.CDLL | None = None
    paged_attention: ctypes.CDLL | None = None
    prefill_scores: ctypes.CDLL | None = None  # only where the CPU has its instructions (AVX512-BF16)
    activation: ctypes.CDLL | None = None
    decode: ctypes.CDLL | None = None
    sampling: ctypes.CDLL | None = None
    encoder: ctypes.CDLL | None = None  # the BERT encoder's attention, add + LayerNorm and GELU
    fallbacks: "FallbackCounts" = field(default_factory=lambda: FallbackCounts(), compare=False, repr=False)

    @classmethod
    def resolve(cls, enabled: bool = True) -> KernelSet:
        """Every kernel built (or found in the cache) and opened, when `enabled` and
        ``NEXTOKEN_NATIVE_KERNELS`` allows; the empty set (PyTorch everywhere) otherwise."""
        if not enabled or not native_allowed():
            return cls()
        libs = {f.name: load(f.name) for f in fields(cls) if f.name != "fallbacks"}
        scores = libs["prefill_scores"]
        if scores is not None and not scores.prefill_scores_supported():
            libs["prefill_scores"] = None
        return cls(**libs)


_fallback_lock = threading.Lock()
fallbacks: Counter = Counter()  # runtime fallbacks from a kernel the plan chose to PyTorch, by what fell back
_counting = threading.local()  # the running engine's `FallbackCounts` (`counting`)


class FallbackCounts:
    """One engine's fallbacks (each `KernelSet` holds one): calls where a kernel its plan chose
    did not take its input and PyTorch ran instead, by what fell back. Thread-safe."""

    def __init__(self):
        self._counts: Counter = Counter()
        self._lock = threading.Lock()

    def add(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


@contextlib.contextmanager
def counting(counts: FallbackCounts):
    """Fallbacks on this thread go to `counts` too while the block runs (a model runner's pass)."""
    previous = getattr(_counting, "counts", None)
    _counting.counts = counts
    try:
        yield
    finally:
        _counting.counts = previous


def count_fallback(what: str) -> None:
    """Count one call where a kernel the execution plan chose did not take its input and PyTorch
    ran instead: in the process's total (`fallbacks`) and the running engine's (`counting`;
    shown in `LLMEngine.stats`, ``/metrics`` and the inspector). Logged once per process."""
    counts = getattr(_counting, "counts", None)
    if counts is not None:
        counts.add(what)
    with _fallback_lock:
        if not fallbacks[what]:
            log.warning("kernel fallback: %s ran on PyTorch (counted in nextoken_kernel_fallbacks_total)", what)
        fallbacks[what] += 1


__all__ = ["FLAGS", "ISAS", "PORTABLE_FLAGS", "FallbackCounts", "KernelSet", "bf16_matmul_native", "count_fallback",
           "counting", "cpu_runs", "default_isa", "fallbacks", "host", "isa_flags", "library_path", "load",
           "native_allowed"]
