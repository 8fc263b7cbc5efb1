"""Our quantized matmul (``kernels/qmatmul.c``) against expanding the weight to bf16 for one
PyTorch matmul, on the linear shapes of SmolLM2-135M and Qwen2.5-1.5B.

    python benchmarks/qmatmul.py                   # rows 1 2 4 5 8 64 128 512
    python benchmarks/qmatmul.py --rows 1 512 --repeat 10
    python benchmarks/qmatmul.py --stream          # decode from memory: GB/s and the cost of 1-8 rows

`--stream` multiplies 1 to 8 activation rows by copies of one weight per format, 1 GiB of them
in turn (far past any cache, as a decode step reads a model's layers; in 2 MiB pages, as the
engine keeps them), and prints the weights'
read rate in GB/s beside this machine's bare read rate, and each row count's time over one
row's (the issue 48 bar: 5 rows at most 1.3x one), then the ratios ik_llama.cpp and mainline
llama.cpp published for 2 / 4 / 8 rows. NEXTOKEN_KERNEL_ISA=avx2 runs the AVX2 loops
on a CPU that has more.

Weights are random codes in the shape's GGUF format (Q4_1 for SmolLM2's, Q4_K for Qwen's, Q6_K
for Qwen's down projection); activations random bf16. For each row count it prints the best of
`--repeat` times in ms for the kernel, for expansion + bf16 matmul, and the kernel's integer
throughput (2 M N K / time); on a CPU with AMX-INT8, also the VNNI loop alone (calls of 32 rows
or more run on AMX tiles there) and the tiles' speedup over it. Timings on a shared VM drift: compare within one run.

`--peak` first measures this CPU's int8 multiply-add ceiling on every instruction kind it has
(`benchmarks/int8_peak.c`, built for the kernel's instruction set, on the same threads) and adds
a column: the share of that ceiling each call reaches, against the instruction the call runs on
(vpmaddubsw on the AVX2 build, 256-bit vpdpbusd with AVX-VNNI, 512-bit on AVX-512 VNNI, AMX
tiles from 32 rows where the CPU has them).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from nextoken.layers.quantization.qweight import PlainCodes, QuantWeight, dequantize_bf16, kernel_matmul, qmatmul

SHAPES = [  # (name, rows N, cols K, format)
    ("smollm2 q/o", 576, 576, "Q4_1"),
    ("smollm2 gate/up", 1536, 576, "Q4_1"),
    ("smollm2 down", 576, 1536, "Q4_1"),
    ("qwen-1.5b k/v", 256, 1536, "Q4_K"),
    ("qwen-1.5b gate/up", 8960, 1536, "Q4_K"),
    ("qwen-1.5b down", 1536, 8960, "Q6_K"),
]


def random_weight(rows: int, cols: int, fmt: str, g: torch.Generator) -> QuantWeight:
    """Random codes and scales in the layout `fmt` maps to (see `layers.quantization.qweight`)."""
    def ints(hi, shape):
        return torch.randint(0, hi, shape, generator=g)

    def f16(shape):
        return (torch.rand(shape, generator=g) * 0.01).half().float()

    if fmt in ("Q4_1", "Q5_1"):  # f16 scale and min per 32 columns
        ng, bits = cols // 32, int(fmt[1])
        return QuantWeight.pack(PlainCodes(ints(1 << bits, (rows, cols)), f16((rows, ng)), None, -f16((rows, ng)), None,
                                           0.0, bits, 32))
    if fmt in ("Q4_K", "Q5_K"):  # 6-bit scales and mins per 32 columns, f16 per 256
        ng, bits = cols // 32, int(fmt[1])
        return QuantWeight.pack(PlainCodes(ints(1 << bits, (rows, cols)), ints(64, (rows, ng)).float(),
                                           f16((rows, ng // 8)), ints(64, (rows, ng)).float(), -f16((rows, ng // 8)),
                                           0.0, bits, 32, 8))
    if fmt in ("Q4_0", "Q5_0", "Q8_0"):  # one f16 scale per 32 columns, min = -offset * scale
        bits, offset = {"Q4_0": (4, 8.0), "Q5_0": (5, 16.0), "Q8_0": (8, 128.0)}[fmt]
        return QuantWeight.pack(PlainCodes(ints(1 << bits, (rows, cols)), f16((rows, cols // 32)), None, None, None,
                                           offset, bits, 32))
    ng = cols // 16  # Q6_K
    return QuantWeight.pack(PlainCodes(ints(64, (rows, cols)), ints(128, (rows, ng)).float() - 64,
                                       f16((rows, ng // 16)), None, None, 32.0, 6, 16, 16))


def int8_peaks(threads: int) -> dict[str, float]:
    """This CPU's int8 multiply-add rates in GOP/s (2 per multiply-add) on `threads` threads, by
    instruction kind (`benchmarks/int8_peak.c`'s lines), built with the kernel build's flags."""
    from nextoken.kernels.cpu import default_isa, isa_flags
    from nextoken.kernels.toolchain import compiler

    flags = [f for f in isa_flags(default_isa()) if f not in ("-shared", "-fPIC", "-O3")]
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "int8_peak"
        subprocess.run([*compiler(), "-O2", *flags, str(Path(__file__).with_name("int8_peak.c")), "-o", str(exe)],
                       check=True)
        out = subprocess.run([str(exe), str(threads)], check=True, capture_output=True, text=True).stdout
    return {kind: 2 * float(gmacs) for kind, gmacs in (line.split() for line in out.splitlines())}


LOOP_KIND = {"avx2": "avx2", "avx-vnni": "avxvnni", "avx512-vnni": "avx512vnni"}  # qmatmul_loop() -> int8_peak


def peak_kind(peaks: dict[str, float], rows: int, amx: bool, loop: str) -> str | None:
    """The instruction kind a call of `rows` rows runs on: AMX tiles from 32 rows where the kernel
    uses them, else the loop the kernel reports (`loop`, from ``qmatmul_loop()``); None for the
    plain C loop."""
    if amx and rows >= 32 and "amx" in peaks:
        return "amx"
    return LOOP_KIND.get(loop)


def best(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


STREAM_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
# the multi-row shape other engines published (issue 62's anchors): time of 2 / 4 / 8 rows over 1
PEER_RATIOS = {"llama.cpp (mainline)": (1.26, 2.28, 4.34), "ik_llama.cpp": (1.04, 1.24, 2.32),
               "ik_llama.cpp interleaved": (1.00, 1.04, 1.82)}


def huge_page_arena(nbytes: int):
    """An anonymous mapping of `nbytes` advised for 2 MiB pages (where the engine keeps its
    weights: `runner.huge_pages`) and a function placing a copy of a tensor in it."""
    import mmap

    buf = mmap.mmap(-1, nbytes + (2 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    mem = torch.frombuffer(buf, dtype=torch.uint8)
    off = [(-mem.data_ptr()) % (2 << 20)]

    def place(t: torch.Tensor) -> torch.Tensor:
        size = t.numel() * t.element_size()
        out = mem[off[0] : off[0] + size].view(t.dtype).view(t.shape)
        out.copy_(t)
        off[0] += -(-size // 64) * 64
        return out
    return buf, place


def stream(rows: list[int], repeat: int, threads: int, n: int = 1536, k: int = 1536, total: int = 1 << 30) -> None:
    """Decode from memory: each format's weight [n, k] copied until the copies hold `total`
    bytes, multiplied in turn (best of `repeat` sweeps)."""
    from nextoken.bench import read_bandwidth
    from nextoken.kernels import default_isa, load

    lib = load("qmatmul")
    print(f"kernel build: {default_isa()} (loop {lib.qmatmul_loop().decode()}); "
          f"bare read {read_bandwidth(threads) / 1e9:.1f} GB/s, {threads} threads")
    g = torch.Generator().manual_seed(0)
    print(f"{'format':<6} " + " ".join(f"{f'{m} rows GB/s':>12}" for m in rows) + "   time / 1 row: " +
          " ".join(f"{m:>4}" for m in rows))
    for fmt in STREAM_FORMATS:
        w0 = random_weight(n, k, fmt, g)
        ncopies = max(1, total // w0.nbytes)
        arena, place = huge_page_arena(ncopies * (w0.nbytes + 5 * 64))  # as the engine keeps weights
        copies = [QuantWeight(**{f: (place(v) if isinstance(v, torch.Tensor) else v) for f, v in vars(w0).items()})
                  for _ in range(ncopies)]
        structs = [w.c_struct() for w in copies]
        nbytes = sum(w.nbytes for w in copies)
        rates, times = [], []
        for m in rows:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)

            def sweep(structs=structs):
                for c in structs:
                    kernel_matmul(x, c, n, lib=lib)
            t = best(sweep, repeat)
            rates.append(nbytes / t / 1e9)
            times.append(t)
        print(f"{fmt:<6} " + " ".join(f"{r:>12.1f}" for r in rates) + "                  " +
              " ".join(f"{t / times[0]:>4.2f}" for t in times))
        del copies, structs, place
        arena.close()
    print("published step cost of 2 / 4 / 8 rows against 1 (ik_llama.cpp discussion #164, an AVX2 Xeon):")
    for name, ratios in PEER_RATIOS.items():
        print(f"  {name:<26} " + " / ".join(f"{r:.2f}" for r in ratios))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 8, 64, 128, 512])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--stream", action="store_true", help="decode from memory (see above)")
    ap.add_argument("--peak", action="store_true", help="measure the int8 ceiling and print each call's share")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.stream:
        stream(args.rows if args.rows != ap.get_default("rows") else [1, 2, 3, 4, 5, 6, 8], args.repeat,
               args.threads or torch.get_num_threads())
        return
    from nextoken.kernels import load

    lib = load("qmatmul")
    amx = bool(lib.qmatmul_amx(-1))  # then each row count runs twice: AMX tiles, and the VNNI loop alone
    peaks = int8_peaks(args.threads or torch.get_num_threads()) if args.peak else {}
    if peaks:
        print("int8 ceiling, GOP/s on " + str(args.threads or torch.get_num_threads()) + " threads: "
              + ", ".join(f"{kind} {rate:.0f}" for kind, rate in peaks.items()))
    g = torch.Generator().manual_seed(0)
    print(f"{'shape':<18} {'rows':>5} {'kernel ms':>10} {'expand+bf16 ms':>15} {'kernel GOP/s':>13}"
          + (f" {'of ceiling':>16}" if peaks else "")
          + (f" {'VNNI-only ms':>13} {'AMX speedup':>12}" if amx else ""))
    for name, n, k, fmt in SHAPES:
        w = random_weight(n, k, fmt, g)
        for m in args.rows:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            t_kernel = best(lambda: qmatmul(x, w, lib=lib), args.repeat)
            t_dense = best(lambda: F.linear(x, dequantize_bf16(w, scratch=True, lib=lib)), args.repeat)
            extra = ""
            kind = peak_kind(peaks, m, amx, lib.qmatmul_loop().decode()) if peaks else None
            if kind:
                extra += f" {2 * m * n * k / t_kernel / 1e9 / peaks[kind]:>5.0%} {kind:>10}"
            if amx:
                lib.qmatmul_amx(0)
                t_vnni = best(lambda: qmatmul(x, w, lib=lib), args.repeat)
                lib.qmatmul_amx(1)
                extra += f" {t_vnni * 1e3:>13.3f} {t_vnni / t_kernel:>11.2f}x"
            print(f"{name + ' ' + fmt:<18} {m:>5} {t_kernel * 1e3:>10.3f} {t_dense * 1e3:>15.3f} "
                  f"{2 * m * n * k / t_kernel / 1e9:>13.0f}" + extra)


if __name__ == "__main__":
    main()
