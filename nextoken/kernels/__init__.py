"""Native kernels of our own, in C, compiled on first use with the system's C compiler.

Each kernel is one ``.c`` file next to this module. `load` compiles it once per source and CPU
(``-O3 -march=native -fopenmp``) into ``<cache>/kernels/`` (see `nextoken.catalog.cache_dir`)
and opens it with ctypes. Every caller keeps a PyTorch path: when no compiler is found, the
build fails, or ``NEXTOKEN_NATIVE_KERNELS=0`` is set, `load` returns None and the caller uses
that path. Which kernels a model runs is decided once, at load, by the execution plan
(`nextoken.runner.plan`); ``enforce_eager`` makes that plan PyTorch alone, which is what the
reference tests compare against. OpenMP: the library asks for ``libgomp.so.1``, the runtime PyTorch has already
loaded, so both share one thread pool (no oversubscription).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
PORTABLE_FLAGS = [f if f != "-march=native" else "-march=x86-64-v2" for f in FLAGS]  # no AVX-512
_loaded: dict[tuple[str, bool], ctypes.CDLL | None] = {}


def native_allowed() -> bool:
    """Whether our kernels may be built and run at all (``NEXTOKEN_NATIVE_KERNELS=0`` says no).
    Which of them a model uses is decided once, at load, by the execution plan
    (`nextoken.runner.plan`), which ``enforce_eager`` turns to PyTorch alone."""
    return os.environ.get("NEXTOKEN_NATIVE_KERNELS", "1") not in ("0", "false", "no")


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


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


def _build(name: str, flags: list[str]) -> Path | None:
    from nextoken.catalog import cache_dir

    source = Path(__file__).with_name(f"{name}.c")
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("no C compiler found; %s runs on the PyTorch path", name)
        return None
    key = hashlib.sha256(_sources(source) + " ".join(flags).encode() + _cpu_key().encode()).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"{name}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        proc = subprocess.run([compiler, *flags, str(source), "-o", str(tmp_so), "-lm"], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            log.warning("building %s failed; using the PyTorch path:\n%s", name, proc.stderr[-2000:])
            return None
        os.replace(tmp_so, out)  # atomic: a concurrent build never sees half a file
    return out


def load(name: str, portable: bool = False) -> ctypes.CDLL | None:
    """The compiled kernel library `name` (``nextoken/kernels/<name>.c``), or None. `portable`
    builds it for any x86-64 CPU (no AVX-512: the kernels' plain C loops), for the tests that
    hold those loops equal to the vectorized ones."""
    if not native_allowed():
        return None
    key = (name, portable)
    if key not in _loaded:
        lib = None
        path = _build(name, PORTABLE_FLAGS if portable else FLAGS)
        if path is not None:
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as exc:
                log.warning("could not load %s (%s); using the PyTorch path", path, exc)
        _loaded[key] = lib
    return _loaded[key]
