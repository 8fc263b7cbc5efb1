"""Embedding throughput: nextoken's `LLM.embed` against `sentence-transformers` on the same model.

    python benchmarks/embeddings.py                    # all-MiniLM-L6-v2, 512 texts, batch 32, 2 threads

Rows: nextoken with ``dtype="auto"`` (the bf16 encoder where the CPU multiplies bf16 in hardware,
else float32), nextoken float32 (the exact reference), nextoken q8_0 (``--quantization q8_0``: the
linears on our int8 kernel), sentence-transformers (PyTorch, float32).

The texts are random word sequences (fixed seed) of 4..120 words, as short queries and passages
mix in a retrieval workload. Both sides take the texts in requests of `--batch` (nextoken: one
`embed` call each, packed without padding; sentence-transformers: ``encode(batch_size=--batch)``,
which sorts by length and pads each batch). Reported: input tokens/s (the tokens both count the
same way: with [CLS] and [SEP]), best of `--rounds`.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="all-minilm-l6-v2")
    ap.add_argument("--num-texts", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    from nextoken import LLM

    from nextoken.embedding import encoder_dtype

    auto = LLM(args.model)  # dtype "auto": bf16 where the CPU multiplies bf16 in hardware
    exact = LLM(args.model, dtype="float32")
    int8 = LLM(args.model, dtype="float32", quantization="q8_0")  # the linears on our int8 kernel
    st = SentenceTransformer(exact.model_path, device="cpu")
    data = texts(args.num_texts)
    tokens = sum(len(o.prompt_token_ids) for o in exact.embed(data))
    batches = [data[i : i + args.batch] for i in range(0, len(data), args.batch)]
    runners = {f"nextoken auto ({str(encoder_dtype()).removeprefix('torch.')})": auto.embed,
               "nextoken float32": exact.embed, "nextoken q8_0": int8.embed,
               "sentence-transformers": lambda b: st.encode(b, batch_size=args.batch)}
    best = dict.fromkeys(runners, 0.0)
    for _ in range(args.rounds):  # alternated: the machine's speed drifts
        for name, fn in runners.items():
            t = time.perf_counter()
            for b in batches:
                fn(b)
            best[name] = max(best[name], tokens / (time.perf_counter() - t))
    ref = best["sentence-transformers"]
    print(f"{args.model}: {args.num_texts} texts, {tokens} tokens, batch {args.batch}, {args.threads} threads")
    for name, rate in best.items():
        print(f"  {name:<28} {rate:8.0f} tokens/s  {rate / ref:5.2f}x sentence-transformers")
    print(json.dumps({"model": args.model, "tokens": tokens, **{k: round(v) for k, v in best.items()}}))


if __name__ == "__main__":
    main()
