"""What this CPU can run: the instruction sets a kernel build can target (`ISAS`, the
compiler flags of each), the CPU's flags (read once from /proc/cpuinfo), and the switches
``NEXTOKEN_KERNEL_ISA`` (build for an older instruction set) and ``NEXTOKEN_NATIVE_KERNELS``
(none of our kernels)."""

from __future__ import annotations

import functools
import logging
import os

log = logging.getLogger("nextoken.kernels")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
# instruction sets a build can target instead of the CPU's own (-march=native): the flags that
# replace -march=native, and the /proc/cpuinfo flags the CPU needs to run that build
ISAS = {
    "portable": (["-march=x86-64-v2"], ()),  # SSE4.2: every kernel's plain C loops
    "avx2": (["-march=x86-64-v3"], ("avx2", "fma", "f16c")),  # AVX2/FMA/F16C, no AVX-512 (Zen 1-3, Haswell..)
    "avxvnni": (["-march=x86-64-v3", "-mavxvnni"], ("avx2", "fma", "f16c", "avx_vnni")),  # + 256-bit vpdpbusd
}


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
    flags = set(cpu_flags().split())
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
def cpu_flags() -> str:
    """The ``flags`` line of /proc/cpuinfo (empty when it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def bf16_matmul_native() -> bool:
    """Whether PyTorch multiplies bf16 matrices in hardware here, at a rate that pays: the CPU
    has AVX512-BF16 or AMX-BF16, oneDNN is not held below them (``ONEDNN_MAX_CPU_ISA``/
    ``DNNL_MAX_CPU_ISA``, as when a CPU without them is emulated), and its bf16 matmul is not
    clearly slower than its float32 one (`bf16_matmul_slower`, timed once). Without the
    instructions PyTorch's bf16 ``bmm`` widens element by element: 60x slower than float32 on an
    AVX2 Zen 4 guest (`benchmarks/profile_prefill.py`); with them, on a 2-core Xeon VM without AMX,
    oneDNN's bf16 matmul ran at 160-170 GFLOP/s against float32's 260-330. Where it is False
    the bf16 paths compute in float32 (prefill's ``p v``, dense bf16 weights beyond the kernel's
    rows) and an ``auto`` encoder runs in float32. Read once."""
    global _BF16_NATIVE
    if _BF16_NATIVE is None:
        flags = set(cpu_flags().split())
        cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
        _BF16_NATIVE = bool(flags & {"avx512_bf16", "amx_bf16"}) and cap not in ONEDNN_WITHOUT_BF16 \
            and not bf16_matmul_slower()
    return _BF16_NATIVE


def bf16_matmul_slower(margin: float = 1.25) -> bool:
    """Whether PyTorch's bf16 matmul takes over `margin` times its float32 one here: the best of
    five alternated ``[256, 1024] x [1024, 1024]`` products in each dtype, on PyTorch's threads
    (about 10-30 ms in all). The margin keeps the answer steady where the two are close; where
    bf16 has its matrix units (AMX, Zen 4) it takes a third to a half of float32's time."""
    import time

    import torch

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 1024, generator=gen), torch.randn(1024, 1024, generator=gen)
    pairs = {torch.float32: (a, b), torch.bfloat16: (a.bfloat16(), b.bfloat16())}
    best = dict.fromkeys(pairs, float("inf"))
    for rnd in range(6):
        for dtype, (x, w) in pairs.items():
            t0 = time.perf_counter()
            torch.mm(x, w)
            if rnd:  # (the first round warms both up)
                best[dtype] = min(best[dtype], time.perf_counter() - t0)
    ratio = best[torch.bfloat16] / best[torch.float32]
    if ratio > margin:
        log.info("PyTorch's bf16 matmul took %.1fx its float32 time here: the bf16 matmuls run in float32 (an auto "
                 "encoder too)", ratio)
    return ratio > margin


# oneDNN's ISA caps below its bf16 instructions (its documented values)
ONEDNN_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
_BF16_NATIVE: bool | None = None
