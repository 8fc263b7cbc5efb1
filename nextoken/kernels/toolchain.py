"""Building a kernel: its library compiled once per source, compiler, flags and CPU into the
cache (`library_path`), under a lock file so that concurrent builds (two processes starting)
compile once; a kernel whose source another includes is served by the including library
(`host`). A library that includes a source of `SPLIT_UNITS` compiles in several units at once
(`_units`), linked into one. Every failure is one warning and None: the caller runs PyTorch."""

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
import sys
import tempfile
from pathlib import Path

from nextoken.kernels.cpu import cpu_flags

log = logging.getLogger("nextoken.kernels")
SOURCES = Path(__file__).parent  # the kernels' .c files
# Sources whose loop functions also compile as this many units of their own, in parallel with the
# library's main unit (each unit the source with -DQM_PARTS=n -DQM_PART=k; the main unit with
# -DQM_PARTS=n only declares them: qmatmul.c's comment). decode.c's native build took 23-29 s on
# one core of a Zen 4 VM, two thirds of it qmatmul's loops; split in four: 16 s on two cores (main
# unit 4-5 s, each part 6-7 s), about 7 with five; the AVX2 build 17 -> 12 s.
SPLIT_UNITS = {"qmatmul.c": 4}


def _included(source: Path, seen: list[Path] | None = None) -> list[Path]:
    """The source and every local file it includes (``#include "x"``), recursively, in the order
    first met."""
    seen = [] if seen is None else seen
    if source in seen:
        return seen
    seen.append(source)
    for line in source.read_text().splitlines():
        line = line.strip()
        if line.startswith("#include \""):
            _included(source.with_name(line.split('"')[1]), seen)
    return seen


def _sources(source: Path) -> bytes:
    """The text of the source and of every local file it includes: the build key."""
    return b"".join(p.read_bytes() for p in _included(source))


def _units(source: Path, tmp: Path) -> list[tuple[list[str], Path, Path]]:
    """The compilation units of `source`'s library: (extra flags, source, object) each; one unit
    (an empty object path: compile and link in one call) unless it includes a `SPLIT_UNITS` source."""
    split = [(p, SPLIT_UNITS[p.name]) for p in _included(source) if p.name in SPLIT_UNITS]
    if not split:
        return [([], source, Path())]
    units = [([f"-DQM_PARTS={n}" for _, n in split], source, tmp / "main.o")]
    for p, n in split:
        units += [([f"-DQM_PARTS={n}", f"-DQM_PART={k}"], p, tmp / f"{p.stem}-{k}.o") for k in range(1, n + 1)]
    return units


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
            if sys.stderr is not None and sys.stderr.isatty():  # a person waits: say why (not in logs)
                sys.stderr.write(f"nextoken: compiling the {name} kernels for this CPU, once "
                                 f"({'about 20 s' if len(_units(source, out.parent)) > 1 else 'seconds'}) ...\n")
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
    """Compile `source` into `out` (atomically: a process opening `out` never sees half a file),
    its units (`_units`) at once, then linked; None after one warning when the compiler fails.
    Raises OSError when it cannot be started."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        units = _units(source, Path(tmp))
        if len(units) == 1:
            error = _run_all([[*compiler, *flags, str(source), "-o", str(tmp_so), "-lm"]])
        else:
            error = _run_all([[*compiler, *flags, *extra, "-c", str(src), "-o", str(obj)] for extra, src, obj in units])
            if error is None:  # link
                error = _run_all([[*compiler, *flags, *(str(obj) for _, _, obj in units), "-o", str(tmp_so), "-lm"]])
        if error is not None:
            log.warning("building %s failed; using the PyTorch path:\n%s", name, error[-2000:])
            return None
        os.replace(tmp_so, out)
    return out


def _run_all(commands: list[list[str]]) -> str | None:
    """Run the commands at once; the first failing one's stderr, or None when all succeed. Raises
    OSError when one cannot be started (the ones started are stopped first)."""
    procs = []
    try:
        for cmd in commands:
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        results = [(p.communicate()[1], p.returncode) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return next((err for err, code in results if code != 0), None)
