"""Sampled decoding against greedy, in one process: the sampler's share of a decode step.

    python benchmarks/sampling.py --model qwen2.5-coder-0.5b-instruct --batch 1 --tokens 128
    python benchmarks/sampling.py --batch 32 --tokens 48 --repeat 2

Each setting (greedy; temperature 1.0; temperature 0.7 + top-p 0.9; top-k 50 + top-p 0.95 +
min-p 0.05 + repetition 1.1 + presence 0.5) generates `--tokens` tokens for `--batch` prompts of
16 random token ids with `ignore_eos`, `--repeat` times, the settings alternated (this VM's speed
drifts within a minute). Decode tokens/s counts the tokens after each request's first over the
time from the batch's first token to its last; the best run of each setting is printed, with its
ratio to greedy. Not a test.
"""

from __future__ import annotations

import argparse
import random

from nextoken import LLM, SamplingParams

SETTINGS = {
    "greedy": dict(temperature=0),
    "temperature 1.0": dict(temperature=1.0),
    "temperature 0.7, top-p 0.9": dict(temperature=0.7, top_p=0.9),
    "top-k 50, top-p 0.95, min-p 0.05, rep 1.1, presence 0.5": dict(
        temperature=1.0, top_k=50, top_p=0.95, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    llm = LLM(model=a.model, max_num_seqs=a.batch, num_threads=a.threads, enable_prefix_caching=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(16)] for _ in range(a.batch)]
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    best = dict.fromkeys(SETTINGS, 0.0)
    for _ in range(a.repeat):
        for name, kw in SETTINGS.items():
            outs = llm.generate(prompts, SamplingParams(max_tokens=a.tokens + 1, ignore_eos=True, seed=1, **kw))
            first = min(o.metrics.first_token_time for o in outs)
            last = max(o.metrics.finished_time for o in outs)
            best[name] = max(best[name], sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (last - first))
    for name, v in best.items():
        print(f"{a.model} batch {a.batch}: {name:58s} {v:8.1f} tok/s  {v / best['greedy']:.3f}x greedy")


if __name__ == "__main__":
    main()
