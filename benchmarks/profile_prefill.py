"""Where one prefill's time goes: every Linear call timed by (bits, input shape), then
`torch.profiler`'s table of ATen ops for the same prefill (attention, norms, activations).
Our C kernels are not ATen ops: their time shows in the Linear figures.

    python benchmarks/profile_prefill.py [--model qwen2.5-coder-1.5b-instruct] [--tokens 512] [--depth N]

With ``--depth N`` the prompt follows N tokens that prefix caching already holds (llama-bench's
``pp512 @ dN``): the figures are those of the new tokens' prefill, attention over all N + tokens.
"""

from __future__ import annotations

import argparse
import collections
import time

from torch.profiler import profile

import nextoken.layers.linear as linear
from nextoken.bench.worker import _prompt
from nextoken.llm import LLM
from nextoken.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--depth", type=int, default=0, help="tokens already cached before the prompt")
    args = ap.parse_args()
    llm = LLM(args.model, num_threads=args.threads, max_num_seqs=1,
              max_model_len=max(2048, args.depth + args.tokens + 16), enable_prefix_caching=args.depth > 0)
    skip = set(getattr(llm.tokenizer, "special_ids", ()))
    context = _prompt(args.depth, llm.config.vocab_size, 2, skip) if args.depth else []
    prompts = iter([context + _prompt(args.tokens, llm.config.vocab_size, seed, skip) for seed in (10, 11, 12)])
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([next(prompts)], params)  # warm-up (kernels built, buffers allocated, the context cached)

    spent: dict[tuple, float] = collections.defaultdict(float)
    forward = linear.Linear.forward

    def timed(self, x):
        start = time.perf_counter()
        y = forward(self, x)
        kind = self.qweight.bits if self.qweight is not None else str(self.dtype)
        spent[(kind, tuple(x.shape))] += time.perf_counter() - start
        return y

    linear.Linear.forward = timed
    try:
        start = time.perf_counter()
        llm.generate([next(prompts)], params)
        total = time.perf_counter() - start
    finally:
        linear.Linear.forward = forward
    print(f"prefill of {args.tokens} tokens: {total * 1e3:.0f} ms ({args.tokens / total:.1f} tok/s); "
          f"linears {sum(spent.values()) * 1e3:.0f} ms")
    for (kind, shape), seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  linear bits={kind} input={shape}: {seconds * 1e3:.1f} ms")
    with profile() as prof:
        llm.generate([next(prompts)], params)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
