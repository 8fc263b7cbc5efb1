"""Keep CPython's freed frame-stack chunks and arenas for reuse in a test process
(`arena_cache.c` says why: Triton's interpreter otherwise maps and unmaps a 16 KiB chunk on
every call across a chunk's boundary, python/cpython#142183). Speed only: without a C compiler,
on another Python implementation or a build without the GIL, nothing is installed."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("arena_cache.c")
CHUNK, ARENA = 16 << 10, 1 << 20  # CPython 3.11-3.13's frame-stack chunk and small-object arena
installed = False


def install() -> bool:
    """Compile `arena_cache.c` into a temporary folder and install it in this process, once;
    whether it is installed."""
    global installed
    from nextoken.kernels.toolchain import compiler

    cc = compiler()
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    if installed or sys.implementation.name != "cpython" or not gil or cc is None:
        return installed
    with tempfile.TemporaryDirectory() as tmp:
        lib_path = Path(tmp) / "arena_cache.so"
        built = subprocess.run([*cc, "-O2", "-shared", "-fPIC", str(SOURCE), "-o", str(lib_path)],
                               capture_output=True)
        if built.returncode != 0:
            return False
        lib = ctypes.PyDLL(str(lib_path))  # (mapped: the file may go)
    lib.install.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
    installed = bool(lib.install(CHUNK, ARENA))
    return installed
