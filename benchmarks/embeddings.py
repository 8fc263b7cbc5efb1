"""Embedding throughput: nextoken's `LLM.embed` against `sentence-transformers` on the same model.

    python benchmarks/embeddings.py                    # all-MiniLM-L6-v2, 512 texts, batch 32, 2 threads

Rows: nextoken with ``dtype="auto"`` (the bf16 encoder where the CPU multiplies bf16 in hardware,
else float32), nextoken float32 (the exact reference), nextoken q8_0 (``--quantization q8_0``: the
linears on our int8 kernel), sentence-transformers (PyTorch, float32), and with ``--onnx-python
PYTHON`` (an interpreter with sentence-transformers' ONNX backend, which needs optimum and
transformers 4.x) its ONNX backend, float32 and its dynamic int8 export
(`benchmarks/st_onnx_worker.py`, in a process of its own, fed the same batches).

The texts are random word sequences (fixed seed) of 4..120 words, as short queries and passages
mix in a retrieval workload. Both sides take the texts in requests of `--batch` (nextoken: one
`embed` call each, packed without padding; sentence-transformers: ``encode(batch_size=--batch)``,
which sorts by length and pads each batch), or with ``--one-call`` all in one call. Reported: input tokens/s (the tokens both count the
same way: with [CLS] and [SEP]), best of `--rounds`.

    python benchmarks/embeddings.py --gemm             # the int8 GEMM alone against PyTorch's linear

``--gemm`` times the encoder's int8 linear (``encoder_linear_s8``, what ``--quantization q8_0``
runs: activation quantization included) against ``F.linear`` in float32 on MiniLM's four shapes
at 2048 rows (a request of 32 texts), alternated, best of 15: GOP/s (2 per multiply-add).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ("model token cache attention layer vector query document search engine batch memory speed "
             "language river mountain city music history science water light energy market health").split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 120))) for _ in range(n)]


class OnnxPeer:
    """`benchmarks/st_onnx_worker.py` in the interpreter `python`: `names` of the backends it
    loaded; `run(batches, batch_size)` -> seconds per backend."""

    def __init__(self, python: str, folder, threads: int):
        import subprocess
        from pathlib import Path

        worker = Path(__file__).with_name("st_onnx_worker.py")
        self.proc = subprocess.Popen([python, str(worker), str(folder), str(threads)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.names = json.loads(self.proc.stdout.readline())

    def run(self, batches: list[list[str]], batch_size: int) -> dict[str, float]:
        self.proc.stdin.write(json.dumps({"batches": batches, "batch_size": batch_size}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())


def gemm_rates(threads: int, rows: int = 2048) -> None:
    """The int8 GEMM against PyTorch's float32 linear on MiniLM's shapes (qkv, o, up, down)."""
    from nextoken.kernels import load
    from nextoken.models.bert import PackedS8

    lib = load("encoder")
    print(f"encoder_linear_s8 ({lib.encoder_linear_s8_loop().decode()} loop) against F.linear float32, "
          f"{rows} rows, {threads} threads, GOP/s")
    for k, n in [(384, 1152), (384, 384), (384, 1536), (1536, 384)]:
        w, b, x = torch.randn(n, k) * 0.05, torch.randn(n), torch.randn(rows, k)
        packed = PackedS8.quantize(w, b, x.abs().amax(0))
        best = [1e9, 1e9]
        for _ in range(15):
            for i, fn in enumerate((lambda: packed(x, lib, torch.float32), lambda: torch.nn.functional.linear(x, w, b))):
                t = time.perf_counter()
                fn()
                best[i] = min(best[i], time.perf_counter() - t)
        ops = 2 * rows * k * n / 1e9
        print(f"  K {k:5d} N {n:5d}: int8 {ops / best[0]:6.0f}  float32 {ops / best[1]:6.0f}  "
              f"ratio {best[1] / best[0]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="all-minilm-l6-v2")
    ap.add_argument("--num-texts", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--onnx-python", default=None, help="a Python with sentence-transformers' ONNX backend")
    ap.add_argument("--one-call", action="store_true",
                    help="every text in one call, as a script embeds a corpus (sentence-transformers then sorts "
                         "them all by length before batching); default: requests of --batch, as a server gets them")
    ap.add_argument("--gemm", action="store_true", help="time the int8 GEMM alone against PyTorch's linear")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.gemm:
        return gemm_rates(args.threads)
    from sentence_transformers import SentenceTransformer

    from nextoken import LLM

    from nextoken.embedding import encoder_dtype

    auto = LLM(args.model)  # dtype "auto": bf16 where the CPU multiplies bf16 in hardware
    exact = LLM(args.model, dtype="float32")
    int8 = LLM(args.model, dtype="float32", quantization="q8_0")  # the linears on our int8 kernel
    st = SentenceTransformer(exact.model_path, device="cpu")
    data = texts(args.num_texts)
    tokens = sum(len(o.prompt_token_ids) for o in exact.embed(data))
    batches = [data] if args.one_call else [data[i : i + args.batch] for i in range(0, len(data), args.batch)]
    runners = {f"nextoken auto ({str(encoder_dtype()).removeprefix('torch.')})": auto.embed,
               "nextoken float32": exact.embed, "nextoken q8_0": int8.embed,
               "sentence-transformers": lambda b: st.encode(b, batch_size=args.batch)}
    onnx = OnnxPeer(args.onnx_python, exact.model_path, args.threads) if args.onnx_python else None
    best = dict.fromkeys([*runners, *(onnx.names if onnx else [])], 0.0)
    for _ in range(args.rounds):  # alternated: the machine's speed drifts
        for name, fn in runners.items():
            t = time.perf_counter()
            for b in batches:
                fn(b)
            best[name] = max(best[name], tokens / (time.perf_counter() - t))
        if onnx is not None:
            for name, seconds in onnx.run(batches, args.batch).items():
                best[name] = max(best[name], tokens / seconds)
    ref = best["sentence-transformers"]
    fastest_onnx = max((v for k, v in best.items() if "onnx" in k), default=None)
    how = "one call" if args.one_call else f"requests of {args.batch}"
    print(f"{args.model}: {args.num_texts} texts, {tokens} tokens, {how}, batch {args.batch}, {args.threads} threads")
    for name, rate in best.items():
        vs_onnx = f"  {rate / fastest_onnx:5.2f}x the fastest ONNX" if fastest_onnx else ""
        print(f"  {name:<32} {rate:8.0f} tokens/s  {rate / ref:5.2f}x sentence-transformers{vs_onnx}")
    print(json.dumps({"model": args.model, "tokens": tokens, **{k: round(v) for k, v in best.items()}}))


if __name__ == "__main__":
    main()
