"""Our C kernels, compiled on first use with the system's C compiler.

Each kernel is one ``.c`` file next to this module. `load` compiles it once per source and CPU
(``-O3 -march=native -fopenmp``) into ``<cache>/kernels/`` (see `nextoken.catalog.cache_dir`)
and opens it with ctypes; a kernel whose source another kernel includes (``qmatmul.c``,
``paged_attention.c`` and ``activation.c`` are in ``decode.c``) is served by the including
library (`host`), so its code is compiled once, not twice (``qmatmul.c`` alone takes 20 s), and
one copy of it runs. Concurrent builds of one library (two processes starting) wait on a lock
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
import fcntl
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
# instruction sets a build can target instead of the CPU's own (-march=native): the flags that
# replace -march=native, and the /proc/cpuinfo flags the CPU needs to run that build
ISAS = {
    "portable": (["-march=x86-64-v2"], ()),  # SSE4.2: every kernel's plain C loops
    "avx2": (["-march=x86-64-v3"], ("avx2", "fma", "f16c")),  # AVX2/FMA/F16C, no AVX-512 (Zen 1-3, Haswell..)
    "avxvnni": (["-march=x86-64-v3", "-mavxvnni"], ("avx2", "fma", "f16c", "avx_vnni")),  # + 256-bit vpdpbusd
}
_loaded: dict[tuple[str, str], ctypes.CDLL | None] = {}


def isa_flags(isa: str) -> list[str]:
    """The compiler flags of a build for `isa` ("native" or a key of `ISAS`). Raises ValueError
    naming the choices for any other name."""
    if isa == "native":
        return list(FLAGS)
    if isa not in ISAS:
        raise ValueError(f"unknown kernel instruction set {isa!r}: choose native or one of {', '.join(ISAS)}")
    out = []
    for f in FLAGS:
        out.extend(ISAS[isa][0] if f == "-march=native" else [f])
    return out


PORTABLE_FLAGS = isa_flags("portable")  # no AVX-512, no AVX2: the plain C loops


def cpu_runs(isa: str) -> bool:
    """Whether this CPU can run a build for `isa` (its /proc/cpuinfo flags)."""
    if isa in ("native", "portable"):
        return True
    flags = set(_cpu_key().split())
    return all(f in flags for f in ISAS[isa][1])


def default_isa() -> str:
    """The instruction set the engine's kernels are built for: ``NEXTOKEN_KERNEL_ISA`` (one of
    `ISAS`, for measuring an older CPU's loops on this one), else native. Raises ValueError for a
    name it does not know, or one this CPU cannot run."""
    isa = os.environ.get("NEXTOKEN_KERNEL_ISA", "").strip() or "native"
    isa_flags(isa)  # validates the name
    if not cpu_runs(isa):
        raise ValueError(f"NEXTOKEN_KERNEL_ISA={isa}: this CPU lacks {', '.join(ISAS[isa][1])}")
    return isa


def native_allowed() -> bool:
    """Whether our kernels may be built and run at all (``NEXTOKEN_NATIVE_KERNELS=0`` says no).
    Which of them a model uses is decided once, at load, by the execution plan
    (`nextoken.runner.plan`), which ``enforce_eager`` turns to PyTorch alone."""
    return os.environ.get("NEXTOKEN_NATIVE_KERNELS", "1") not in ("0", "false", "no")


@functools.cache
def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def bf16_matmul_native() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX-BF16). Without
    it PyTorch's bf16 ``bmm`` widens element by element: 60x slower than float32 on an AVX2 Zen 4
    guest (`benchmarks/profile_prefill.py`), so the PyTorch attention paths compute in float32
    there. A fact of the CPU, read once."""
    global _BF16_NATIVE
    if _BF16_NATIVE is None:
        flags = set(_cpu_key().split())
        _BF16_NATIVE = bool(flags & {"avx512_bf16", "amx_bf16"})
    return _BF16_NATIVE


_BF16_NATIVE: bool | None = None


def _sources(source: Path, seen: set[Path] | None = None) -> bytes:
    """The source and every local file it includes (``#include "x"``), recursively: the build key."""
    seen = set() if seen is None else seen
    if source in seen:
        return b""
    seen.add(source)
    text = source.read_bytes()
    out = text
    for line in text.decode().splitlines():
        line = line.strip()
        if line.startswith("#include \""):
            out += _sources(source.with_name(line.split('"')[1]), seen)
    return out


def _compiler() -> list[str] | None:
    """The C compiler command: ``$CC`` split as a shell would (``"ccache gcc"`` is two words),
    else gcc or cc on the PATH; None when there is none."""
    cc = shlex.split(os.environ.get("CC") or "")
    if cc:
        return cc if shutil.which(cc[0]) else None
    found = shutil.which("gcc") or shutil.which("cc")
    return [found] if found else None


def library_path(name: str, flags: list[str], compiler: list[str]) -> Path:
    """Where the build of `name` with these flags and compiler for this CPU is cached."""
    from nextoken.catalog import cache_dir

    source = Path(__file__).with_name(f"{name}.c")
    key = hashlib.sha256(_sources(source) + " ".join([*compiler, *flags]).encode() + _cpu_key().encode())
    return cache_dir() / "kernels" / f"{name}-{key.hexdigest()[:16]}.so"


@functools.cache
def host(name: str) -> str:
    """The kernel whose library serves kernel `name`: the outermost kernel source that includes
    ``<name>.c`` (directly or through another), else `name` itself."""
    here = Path(__file__).parent
    for other in sorted(p.stem for p in here.glob("*.c")):
        if other != name and f'#include "{name}.c"' in (here / f"{other}.c").read_text():
            return host(other)
    return name


def _build(name: str, flags: list[str], force: bool = False) -> Path | None:
    """The cached library of kernel `name`, compiled first if needed (or when `force`). Every
    failure (no compiler, a cache folder that cannot be written, a compiler that fails or cannot
    start) is one warning and None: the caller then runs PyTorch."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found (CC=%r); %s runs on the PyTorch path", os.environ.get("CC"), name)
        return None
    out = library_path(name, flags, compiler)
    if out.exists() and not force:
        return out
    source = Path(__file__).with_name(f"{name}.c")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with _build_lock(out):
            if out.exists() and not force:  # another process built it while this one waited
                return out
            return _compile(name, compiler, flags, source, out)
    except OSError as exc:  # unwritable cache folder, a compiler that cannot be started
        log.warning("cannot build %s in %s (%s); using the PyTorch path", name, out.parent, exc)
        return None


@contextlib.contextmanager
def _build_lock(out: Path):
    """Hold an exclusive lock on ``<out>.lock`` (flock: released if the process dies)."""
    with open(out.with_name(out.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile(name: str, compiler: list[str], flags: list[str], source: Path, out: Path) -> Path | None:
    """Compile `source` into `out` (atomically: a process opening `out` never sees half a file);
    None after one warning when the compiler fails. Raises OSError when it cannot be started."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        proc = subprocess.run([*compiler, *flags, str(source), "-o", str(tmp_so), "-lm"], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            log.warning("building %s failed; using the PyTorch path:\n%s", name, proc.stderr[-2000:])
            return None
        os.replace(tmp_so, out)
    return out


P = ctypes.c_void_p
_I64, _INT, _F32 = ctypes.c_int64, ctypes.c_int, ctypes.c_float
_PAGED = (_INT, [P, P, P, P, _I64, P, P, _I64, _I64, _I64, _I64, _I64, _I64, _F32, P])
SIGNATURES = {  # C function -> (result type, argument types), as the .c files declare them
    "qmatmul": (_INT, [P, _INT, _I64, P, P, _INT, _I64]),
    "qmatmul_quantize": (_INT, [P, _INT, _I64, _I64, _I64, P, P]),
    "qdequant_bf16_t": (None, [P, P]),
    "qlookup_bf16": (_INT, [P, P, _I64, P]),
    "qmatmul_vectorized": (_INT, []),
    "qmatmul_loop": (ctypes.c_char_p, []),
    "qmatmul_amx": (_INT, [_INT]),
    "dense_bf16_vectorized": (_INT, []),
    "paged_decode_bf16": _PAGED,
    "paged_decode_f32": _PAGED,
    "paged_decode_int8": (_INT, [P, P, P, P, P, *_PAGED[1][3:]]),
    "paged_decode_max_head_dim": (_INT, []),
    "paged_decode_max_group": (_INT, []),
    "prefill_scores_supported": (_INT, []),
    "prefill_pack_keys": (None, [P, _I64, _I64, _I64, P]),
    "prefill_scores": (_INT, [P, P, _I64, _I64, _I64, _I64, _I64, _F32, P]),
    "prefill_softmax": (_INT, [P, _I64, _I64, _I64, _I64, P]),
    "kv_quantize_rows": (None, [P, _I64, _I64, P, P]),
    "silu_mul_bf16": (None, [P, P, P, _I64]),
    "activation_vectorized": (_INT, []),
    "rms_norm_rows_bf16": (None, [P, P, _I64, _I64, _F32, P]),
    "rms_norm_rows_gemma": (None, [P, P, _I64, _I64, _F32, P]),
    "gelu_tanh_mul_bf16": (None, [P, P, P, _I64]),
    "sample_rows": (_INT, [P, _I64, _I64, P, P, P, P, P, P, P]),
    "decode_layers": (_INT, [P, _I64, P, P, P]),  # (layer_t *, L, decode_call_t *, arch_t *, lora_t *)
}


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Give every function of `lib` that we call its argument and result types (ctypes then
    checks each call's arguments instead of guessing C ints)."""
    for fn, (restype, argtypes) in SIGNATURES.items():
        if hasattr(lib, fn):
            getattr(lib, fn).restype = restype
            getattr(lib, fn).argtypes = argtypes
    return lib


def _open(name: str, flags: list[str]) -> ctypes.CDLL | None:
    """Build (or find) and open kernel `name`; a cached library that cannot be opened (damaged,
    or built elsewhere) is rebuilt once; after that, one warning and None."""
    path = _build(name, flags)
    for attempt in range(2):
        if path is None:
            return None
        try:
            return _declare(ctypes.CDLL(str(path)))
        except OSError as exc:
            if attempt == 0:
                log.warning("could not open %s (%s); building it again", path, exc)
                path = _build(name, flags, force=True)
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
