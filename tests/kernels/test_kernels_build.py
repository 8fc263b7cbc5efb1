"""Building and opening our C kernels (`nextoken.kernels`): every failure falls back to PyTorch
with one warning, never an exception; the compiler may be a command with arguments."""

from __future__ import annotations

import ctypes
import logging
import shutil

import pytest

from nextoken import kernels
from nextoken.kernels import abi, cpu, toolchain

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc on this machine")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty kernel cache of its own and no library opened yet."""
    monkeypatch.setenv("NEXTOKEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "_loaded", {})
    return tmp_path


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@needs_gcc
def test_cc_with_arguments_builds(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", f"{shutil.which('gcc')} -DNEXTOKEN_CC_HAS_ARGUMENTS")
    lib = kernels.load("sampling")  # the smallest library: half a second to build
    assert lib is not None and lib.sample_rows.restype is ctypes.c_int
    assert not warnings_of(caplog)


@pytest.mark.parametrize("cc", ["no-such-compiler-here", "false"])
def test_missing_or_failing_compiler_is_one_warning(fresh, monkeypatch, caplog, cc):
    monkeypatch.setenv("CC", cc)
    with caplog.at_level(logging.WARNING):
        assert kernels.load("paged_attention") is None
    assert len(warnings_of(caplog)) == 1 and "PyTorch path" in warnings_of(caplog)[0]


def test_unwritable_cache_folder_is_one_warning(fresh, monkeypatch, caplog):
    blocker = fresh / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("NEXTOKEN_CACHE", str(blocker))
    with caplog.at_level(logging.WARNING):
        assert kernels.load("paged_attention") is None
    assert len(warnings_of(caplog)) == 1 and "cannot build" in warnings_of(caplog)[0]


@needs_gcc
def test_a_damaged_cached_library_is_rebuilt(fresh, caplog):
    path = kernels.library_path("sampling", kernels.FLAGS, toolchain.compiler())
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a shared library")
    with caplog.at_level(logging.WARNING):
        lib = kernels.load("sampling")
    assert lib is not None and lib.sample_rows.restype is ctypes.c_int
    assert any("building it again" in w for w in warnings_of(caplog))


@needs_gcc
def test_dlopen_failure_falls_back(fresh, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise OSError("dlopen refused")

    monkeypatch.setattr(kernels.ctypes, "CDLL", refuse)
    with caplog.at_level(logging.WARNING):
        assert kernels.load("sampling") is None
    assert any("using the PyTorch path" in w for w in warnings_of(caplog))


@needs_gcc
def test_a_cpu_without_vnni_is_told_so(fresh, monkeypatch, caplog):
    """The portable build (what a CPU without AVX-512 gets) reports plain loops: one info line."""
    monkeypatch.setattr(cpu, "FLAGS", kernels.PORTABLE_FLAGS)
    with caplog.at_level(logging.INFO):
        lib = kernels.load("qmatmul")
    assert lib is not None and lib.qmatmul_vectorized() == 0
    assert any("no AVX-512 VNNI" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
    assert not any("no AVX-512 VNNI" in w for w in warnings_of(caplog))


@needs_gcc
def test_functions_have_declared_types():
    """(The libraries the suite built already: the declarations are checked on what the engine
    loads; the build from an empty cache is the tests above.)"""
    lib = kernels.load("decode")  # includes qmatmul.c and paged_attention.c
    libs = [lib, kernels.load("prefill_scores"), kernels.load("activation"), kernels.load("sampling"),
            kernels.load("encoder")]
    for fn, (restype, argtypes) in abi.SIGNATURES.items():
        f = next(getattr(x, fn) for x in libs if hasattr(x, fn))
        assert f.argtypes == argtypes and f.restype == restype, fn
    with pytest.raises(ctypes.ArgumentError):  # a wrong argument is caught before C sees it
        lib.qmatmul_quantize(None, 0, "one row", 32, 32, None, None)


@needs_gcc
def test_a_build_tells_a_person_at_a_terminal_what_it_waits_for(fresh, monkeypatch):
    """A compile at a terminal (stderr a TTY) prints one line saying what is compiled and that it
    happens once; opening the cached library prints nothing, nor does a compile whose stderr is a
    pipe or a log file (servers, tests)."""
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, says in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(toolchain.sys, "stderr", stream)
        assert toolchain.build("sampling", kernels.FLAGS, force=True) is not None
        assert ("compiling the sampling kernels for this CPU, once" in stream.getvalue()) is says
        before = stream.getvalue()
        assert toolchain.build("sampling", kernels.FLAGS) is not None  # cached: silent
        assert stream.getvalue() == before


@needs_gcc
def test_concurrent_builds_compile_once(fresh, monkeypatch):
    """Two workers (here threads) asking for a library no one has built yet: one compiles, the
    other waits on the lock and opens the same file."""
    import stat
    from concurrent.futures import ThreadPoolExecutor

    calls = fresh / "calls"
    cc = fresh / "cc"
    cc.write_text(f'#!/bin/sh\necho compile >> {calls}\nexec {shutil.which("gcc")} "$@"\n')
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(cc))
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: toolchain.build("sampling", kernels.FLAGS), range(2)))
    assert paths[0] == paths[1] and paths[0].exists()
    assert calls.read_text().split() == ["compile"]


@needs_gcc
def test_an_included_kernel_is_served_by_the_library_that_includes_it():
    """qmatmul.c, paged_attention.c and activation.c are compiled into decode.c's library: one
    build, one copy of their code in the process; every function they declare is there."""
    from pathlib import Path

    src = Path(kernels.__file__).parent
    for name in ("qmatmul", "paged_attention", "activation"):
        assert kernels.host(name) == "decode" and f'#include "{name}.c"' in (src / "decode.c").read_text()
        assert kernels.load(name) is kernels.load("decode")
    assert kernels.host("sampling") == "sampling" and kernels.host("prefill_scores") == "prefill_scores"
    lib = kernels.load("decode")
    for fn in abi.SIGNATURES:
        if fn.startswith(("qmatmul", "qdequant", "qlookup", "dense_bf16", "paged_decode", "silu", "gelu", "rms_norm")):
            assert hasattr(lib, fn), fn


def test_native_kernels_can_be_switched_off(fresh, monkeypatch):
    monkeypatch.setenv("NEXTOKEN_NATIVE_KERNELS", "0")
    assert kernels.load("qmatmul") is None


@needs_gcc
def test_avx512_bf16_loops_compile():
    """The AVX512-BF16 bodies (vdpbf16ps: dense_bf16.c, paged_attention.c, prefill_scores.c) cannot
    run on a CPU without those instructions, but they must compile: a build for such a CPU
    (Sapphire Rapids) of every kernel, syntax and types checked, nothing run."""
    import subprocess
    from pathlib import Path

    check_every_unit(["-march=sapphirerapids"])


@needs_gcc
@pytest.mark.parametrize("isa", ["avx2", "avxvnni"])
def test_older_instruction_set_builds_compile(isa):
    """The AVX2 and AVX-VNNI bodies compile with every warning an error, on any machine: a CPU
    without those instructions cannot run them, but a user's CPU may be one that has them."""
    import subprocess
    from pathlib import Path

    check_every_unit([f for f in kernels.isa_flags(isa) if f.startswith("-m")])


def check_every_unit(march: list[str]) -> None:
    """Syntax and types of every kernel library for `march`, every warning an error: each source
    whole (a build by hand) and each unit of its split build (`toolchain._units`)."""
    import subprocess
    from pathlib import Path

    src = Path(kernels.__file__).parent
    checks = []
    for name in ("decode", "prefill_scores", "sampling", "encoder"):
        units = toolchain._units(src / f"{name}.c", Path("/tmp"))
        for extra, unit, _ in [([], src / f"{name}.c", None)] + (units if len(units) > 1 else []):
            cmd = ["gcc", "-fsyntax-only", *march, "-fopenmp", "-std=c11", "-Wall", "-Werror", *extra, str(unit)]
            checks.append((name, extra, subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)))
    for name, extra, proc in checks:  # (all at once)
        err = proc.communicate()[1]
        assert proc.returncode == 0, (name, extra, err[-2000:])


@needs_gcc
def test_a_split_build_compiles_its_units_at_once_and_names_a_failing_one(fresh, monkeypatch, caplog):
    """decode.c's library compiles as a main unit and qmatmul.c's four parts (`SPLIT_UNITS`), all
    started before any ends; a failing part costs the build (one warning with its error, None:
    the PyTorch path), and no compiler is left running."""
    import stat

    log = fresh / "units"
    cc = fresh / "cc"  # a stand-in: records each unit, fails part 3, never compiles
    cc.write_text("#!/bin/sh\n"
                  f'echo "start $*" >> {log}\n'
                  'case "$*" in *-DQM_PART=3*) echo "part three broke" >&2; exit 1;; esac\n'
                  "sleep 0.5\n"
                  f'echo "end" >> {log}\n')
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(cc))
    with caplog.at_level("WARNING", logger="nextoken.kernels"):
        assert toolchain.build("decode", kernels.FLAGS) is None
    lines = log.read_text().splitlines()
    starts = [line for line in lines if line.startswith("start")]
    assert len(starts) == 5 and all(" -c " in line for line in starts)
    assert lines[:5] == starts  # every unit started before the first one ended
    assert sum("decode.c" in line and "-DQM_PARTS=4" in line and "QM_PART=" not in line for line in starts) == 1
    assert sorted(line.split("-DQM_PART=")[1][0] for line in starts if "-DQM_PART=" in line) == ["1", "2", "3", "4"]
    assert "building decode failed" in caplog.text and "part three broke" in caplog.text
    assert lines.count("end") == 4  # the others were waited for
    assert [u[2].name for u in toolchain._units(toolchain.SOURCES / "sampling.c", fresh)] == [""]  # one unit


def test_kernel_isa_names_are_checked(monkeypatch):
    monkeypatch.setenv("NEXTOKEN_KERNEL_ISA", "avx9000")
    with pytest.raises(ValueError, match="unknown kernel instruction set 'avx9000'"):
        kernels.default_isa()
    monkeypatch.setenv("NEXTOKEN_KERNEL_ISA", "portable")
    assert kernels.default_isa() == "portable"
    assert "-march=x86-64-v3" in kernels.isa_flags("avx2") and "-march=native" not in kernels.isa_flags("avx2")


def c_signatures(name: str) -> list[tuple[str, list[str]]]:
    """(result type, argument types) of each definition of C function `name` in the kernels'
    sources (``int f(const int64_t *rows, int64_t B, ...) {``; one per build variant), whitespace
    normalised."""
    import re
    from pathlib import Path

    src = Path(kernels.__file__).parent
    pattern = re.compile(r"^((?:const\s+)?[A-Za-z_][\w ]*?\s*\**)\s*\b" + name + r"\s*\(([^)]*)\)\s*\{", re.M)
    found = [m for f in sorted(src.glob("*.c")) for m in pattern.finditer(f.read_text())]
    assert found, name

    def args(params: str) -> list[str]:
        return [] if params.strip() in ("", "void") else [" ".join(p.split()[:-1]) + "*" * p.split()[-1].count("*")
                                                         for p in params.split(",")]
    return [(" ".join(m.group(1).split()), args(m.group(2))) for m in found]


def ctype_of(c: str):
    """The ctypes type a C type is declared as (`abi.SIGNATURES`): any pointer is void *, but a
    returned string."""
    c = c.replace("const ", "").strip()
    if c.endswith("*"):
        return ctypes.c_char_p if c == "char *" else ctypes.c_void_p
    return {"void": None, "int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}[c]


def test_the_abi_table_matches_the_c_sources():
    """Each C function's one declaration on the Python side (`kernels.abi.SIGNATURES`) has the
    argument count and types of its definition in the ``.c`` files: a parameter added, dropped or
    retyped in C without the table fails here, not as a crash at run time (the decode step once
    lost its lora argument in the table)."""
    for fn, (restype, argtypes) in abi.SIGNATURES.items():
        for result, params in c_signatures(fn):
            assert ctype_of(result) is restype, (fn, result)
            assert [ctype_of(p) for p in params] == list(argtypes), (fn, params)


@pytest.mark.parametrize("bf16_ms,slower", [(3.0, True), (1.2, False), (0.4, False)])
def test_bf16_matmul_slower_compares_the_best_times_with_a_margin(monkeypatch, bf16_ms, slower):
    """`cpu.bf16_matmul_slower`: bf16 over 1.25x float32's best time is slower; closer, or faster
    (the matrix units), is not. (Stand-in products that advance a stand-in clock by fixed times in
    each dtype: no real timing in the test.)"""
    import time

    import torch

    clock = [0.0]

    def mm(x, w):
        clock[0] += (bf16_ms if x.dtype == torch.bfloat16 else 1.0) / 1000
        return x

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    assert cpu.bf16_matmul_slower() is slower


@pytest.mark.parametrize("cap,native", [("", True), ("avx2", False), ("AVX512_CORE_VNNI", False),
                                        ("AVX512_CORE_BF16", True), ("AVX512_CORE_AMX", True)])
def test_bf16_matmul_is_native_only_with_the_instructions_and_onednn_allowed_them(monkeypatch, cap, native):
    """A CPU with AVX512-BF16 whose oneDNN is held to AVX2 (as when an AVX2 CPU is emulated), or
    whose bf16 matmul times clearly slower than its float32 one, computes bf16 matmuls as one
    without: the float32 paths apply."""
    monkeypatch.setattr(cpu, "cpu_flags", lambda: "flags : fpu avx2 avx512f avx512_bf16")
    monkeypatch.setattr(cpu, "_BF16_NATIVE", None)
    monkeypatch.setattr(cpu, "bf16_matmul_slower", lambda: False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert cpu.bf16_matmul_native() is native
    monkeypatch.setattr(cpu, "_BF16_NATIVE", None)
    monkeypatch.setattr(cpu, "bf16_matmul_slower", lambda: True)  # (the instructions, at a rate that does not pay)
    assert cpu.bf16_matmul_native() is False
    monkeypatch.setattr(cpu, "cpu_flags", lambda: "flags : fpu avx2 fma")
    monkeypatch.setattr(cpu, "_BF16_NATIVE", None)
    assert cpu.bf16_matmul_native() is False
