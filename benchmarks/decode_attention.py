"""Decode attention at depth: our C kernel (``kernels/paged_attention.c``) reading the paged
cache in place, against the PyTorch paths, on SmolLM2-135M's and Qwen2.5-1.5B's head shapes.

    python benchmarks/decode_attention.py                       # depths 512 4096 8192, batch 1 and 8
    python benchmarks/decode_attention.py --depth 4096 --batch 1 --repeat 50

For each shape, depth and batch it prints the best of `--repeat` times per layer call in us,
for a bf16 cache and an int8 cache (``--kv-cache-dtype int8``: codes and row scales), and the
KV bytes the call reads over that time (GB/s): decode attention reads every cached
key and value once, so that figure against the machine's read bandwidth says how close to
the memory wall the kernel runs. Blocks are handed out in a scrambled order, as a long-lived
server's block pool does. Timings on a shared VM drift: compare within one run.
"""

from __future__ import annotations

import argparse
import time

import torch

from nextoken.kv_cache.tensors import Int8Rows, quantize_rows
from nextoken.layers.attention import AttentionMetadata, _decode_chunk, _lone_decode, native_decode_attention

SHAPES = [("smollm2", 9, 3, 64), ("qwen-1.5b", 12, 2, 128)]  # (name, heads, KV heads, head_dim)
BLOCK = 16


def case(heads: int, kv_heads: int, dim: int, depth: int, batch: int, dtype=torch.bfloat16):
    """q [B, H, D], caches [Hkv, NB, BS, D] and the block tables of `batch` sequences of `depth` keys."""
    g = torch.Generator().manual_seed(0)
    per_seq = -(-depth // BLOCK)
    nb = per_seq * batch + 1
    kc = torch.randn(kv_heads, nb, BLOCK, dim, generator=g).to(dtype)
    vc = torch.randn(kv_heads, nb, BLOCK, dim, generator=g).to(dtype)
    order = torch.randperm(nb - 1, generator=g) + 1
    tables = order[: per_seq * batch].view(batch, per_seq)
    q = torch.randn(batch, heads, dim, generator=g).to(dtype)
    return q, kc, vc, tables, [depth] * batch


def best(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--depth", type=int, nargs="+", default=[512, 4096, 8192])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeat", type=int, default=20)
    a = p.parse_args()
    print(f"threads {torch.get_num_threads()}; best of {a.repeat}; us per layer call (GB/s of KV read)")
    print("| shape | depth | batch | C kernel, bf16 cache | C kernel, int8 cache | PyTorch, bf16 cache |")
    print("|---|---|---|---|---|---|")
    from nextoken.kernels import load

    lib = load("paged_attention")
    for name, h, hkv, d in SHAPES:
        for depth in a.depth:
            for batch in a.batch:
                q, kc, vc, tables, lens = case(h, hkv, d, depth, batch)
                kv_bytes = 2 * hkv * d * kc.element_size() * depth * batch
                native = best(lambda: native_decode_attention(q, kc, vc, tables, lens, 0.125, lib=lib), a.repeat)
                k8, v8 = Int8Rows(*quantize_rows(kc), kc.dtype), Int8Rows(*quantize_rows(vc), vc.dtype)
                int8 = best(lambda: native_decode_attention(q, k8, v8, tables, lens, 0.125, lib=lib), a.repeat)
                int8_bytes = 2 * hkv * (d + 4) * depth * batch
                if batch == 1:
                    meta = AttentionMetadata(torch.zeros(1, dtype=torch.int64), [0, 1], lens, tables, 1, BLOCK)
                    torch_fn = lambda: _lone_decode(q, kc, vc, meta, 0.125)  # noqa: E731
                else:
                    torch_fn = lambda: _decode_chunk(q, kc, vc, tables, torch.tensor(lens), BLOCK, 0.125)  # noqa: E731
                ref = best(torch_fn, max(3, a.repeat // 4))
                cells = [f"{t * 1e6:.0f} ({n / t / 1e9:.1f})" for t, n in ((native, kv_bytes), (int8, int8_bytes),
                                                                           (ref, kv_bytes))]
                print(f"| {name} | {depth} | {batch} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
