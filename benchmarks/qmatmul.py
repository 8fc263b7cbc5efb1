"""Our quantized matmul (``kernels/qmatmul.c``) against expanding the weight to bf16 for one
PyTorch matmul, on the linear shapes of SmolLM2-135M and Qwen2.5-1.5B.

    python benchmarks/qmatmul.py                   # rows 1 2 4 5 8 64 128 512
    python benchmarks/qmatmul.py --rows 1 512 --repeat 10

Weights are random codes in the shape's GGUF format (Q4_1 for SmolLM2's, Q4_K for Qwen's, Q6_K
for Qwen's down projection); activations random bf16. For each row count it prints the best of
`--repeat` times in ms for the kernel, for expansion + bf16 matmul, and the kernel's integer
throughput (2 M N K / time). Timings on a shared VM drift: compare within one run.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from nextoken.layers.quantization.qweight import PlainCodes, QuantWeight, dequantize_bf16, qmatmul

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

    if fmt == "Q4_1":
        ng = cols // 32
        return QuantWeight.pack(PlainCodes(ints(16, (rows, cols)), f16((rows, ng)), None, -f16((rows, ng)), None,
                                           0.0, 4, 32))
    if fmt == "Q4_K":
        ng = cols // 32
        return QuantWeight.pack(PlainCodes(ints(16, (rows, cols)), ints(64, (rows, ng)).float(), f16((rows, ng // 8)),
                                           ints(64, (rows, ng)).float(), -f16((rows, ng // 8)), 0.0, 4, 32, 8))
    ng = cols // 16  # Q6_K
    return QuantWeight.pack(PlainCodes(ints(64, (rows, cols)), ints(128, (rows, ng)).float() - 64,
                                       f16((rows, ng // 16)), None, None, 32.0, 6, 16, 16))


def best(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 8, 64, 128, 512])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"{'shape':<18} {'rows':>5} {'kernel ms':>10} {'expand+bf16 ms':>15} {'kernel GOP/s':>13}")
    for name, n, k, fmt in SHAPES:
        w = random_weight(n, k, fmt, g)
        for m in args.rows:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            t_kernel = best(lambda: qmatmul(x, w), args.repeat)
            t_dense = best(lambda: F.linear(x, dequantize_bf16(w, scratch=True)), args.repeat)
            print(f"{name + ' ' + fmt:<18} {m:>5} {t_kernel * 1e3:>10.3f} {t_dense * 1e3:>15.3f} "
                  f"{2 * m * n * k / t_kernel / 1e9:>13.0f}")


if __name__ == "__main__":
    main()
