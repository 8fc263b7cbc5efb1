"""Building a kernel: its library compiled once per source, compiler, flags and CPU into the
cache (`library_path`), under a lock file so that concurrent builds (two processes starting)
compile once; a kernel whose source another includes is served by the including library
(`host`). Every failure is one warning and None: the caller runs PyTorch."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

from nextoken.kernels.cpu import cpu_flags

log = logging.getLogger("nextoken.kernels")
SOURCES = Path(__file__).parent  # the kernels' .c files

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


def compiler() -> list[str] | None:
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

    source = SOURCES / f"{name}.c"
    key = hashlib.sha256(_sources(source) + " ".join([*compiler, *flags]).encode() + cpu_flags().encode())
    return cache_dir() / "kernels" / f"{name}-{key.hexdigest()[:16]}.so"


@functools.cache
def host(name: str) -> str:
    """The kernel whose library serves kernel `name`: the outermost kernel source that includes
    ``<name>.c`` (directly or through another), else `name` itself."""
    here = SOURCES
    for other in sorted(p.stem for p in here.glob("*.c")):
        if other != name and f'#include "{name}.c"' in (here / f"{other}.c").read_text():
            return host(other)
    return name


def build(name: str, flags: list[str], force: bool = False) -> Path | None:
    """The cached library of kernel `name`, compiled first if needed (or when `force`). Every
    failure (no compiler, a cache folder that cannot be written, a compiler that fails or cannot
    start) is one warning and None: the caller then runs PyTorch."""
    cc = compiler()
    if cc is None:
        log.warning("no C compiler found (CC=%r); %s runs on the PyTorch path", os.environ.get("CC"), name)
        return None
    out = library_path(name, flags, cc)
    if out.exists() and not force:
        return out
    source = SOURCES / f"{name}.c"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with _build_lock(out):
            if out.exists() and not force:  # another process built it while this one waited
                return out
            return _compile(name, cc, flags, source, out)
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
