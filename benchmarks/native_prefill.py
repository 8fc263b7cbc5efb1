"""Where a prefill should leave the one-call C step (`layers.native_decode`) for the PyTorch
layers: one prompt's prefill (its first token greedy) of N tokens both ways, alternating in one
process (this VM's speed drifts), median of `--reps`. The bound `MAX_PREFILL_TOKENS`
(`kernels.decode_step`) is set from this table.

    python benchmarks/native_prefill.py [--model smollm2-135m-instruct] [--tokens 16 32 64 128 192 256] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

from nextoken.bench.worker import _prompt
from nextoken.layers.native_decode import NativeDecoder
from nextoken.llm import LLM
from nextoken.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 32, 64, 128, 192, 256])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    llm = LLM(args.model, num_threads=args.threads, max_num_seqs=1, enable_prefix_caching=False)
    skip = set(getattr(llm.tokenizer, "special_ids", ()))
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    takes = NativeDecoder.takes
    ways = {"one C call": lambda new_tokens, prefill_len, ring_tokens=None:  # (a prompt within a ring)
            new_tokens == 1 or prefill_len <= (ring_tokens or prefill_len),
            "PyTorch layers": lambda new_tokens, prefill_len, ring_tokens=None: new_tokens == 1}
    print(f"{args.model}, prefill of one prompt (first token greedy), median of {args.reps}, ms")
    print(f"{'tokens':>7}  {'one C call':>11}  {'PyTorch layers':>15}  ratio")
    seed = 100
    try:
        for n in args.tokens:
            times: dict[str, list[float]] = {w: [] for w in ways}
            for _ in range(args.reps + 1):  # the first round warms up
                for way, rule in ways.items():
                    NativeDecoder.takes = staticmethod(rule)
                    seed += 1
                    prompt = _prompt(n, llm.config.vocab_size, seed, skip)
                    start = time.perf_counter()
                    llm.generate([prompt], params)
                    times[way].append(time.perf_counter() - start)
            c, t = (statistics.median(times[w][1:]) * 1e3 for w in ways)
            print(f"{n:>7}  {c:>11.1f}  {t:>15.1f}  {t / c:.2f}x")
    finally:
        NativeDecoder.takes = takes


if __name__ == "__main__":
    main()
