"""The host's share of a decode step: everything the engine does around the model's pass.

    python benchmarks/host_step.py                                   # 64 and 256 sequences
    python benchmarks/host_step.py --seqs 256 --async --profile prof.txt

On a GPU the pass is a CUDA graph, and with async scheduling the host's work for the next step
runs while it does: when that work takes longer than the graph, the host sets the pace (the
H200's 64-sequence step of Qwen2.5-0.5B, 2.03 ms against its graph's 1.23). This script takes the
pass away to time the rest on the CPU: the model's `forward` returns zeros and `compute_logits`
rows of a fixed random table (a narrow vocabulary, so that the draw, the device's work on a GPU,
costs little), while the scheduler, the KV cache's bookkeeping, the pass's inputs (`layout`,
`model_inputs`), the sampler's host side, the detokenizer (the model's real tokenizer) and the
outputs run as they do. Prints each run's median step (the decodes of every sequence), in
milliseconds and per sequence, greedy and sampled (temperature 0.8, top-p 0.95).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])
from nextoken import LLM, SamplingParams  # noqa: E402

WIDTH = 4096  # the logits' width: ids below it are real tokens of the vocabulary


def stub_pass(llm: LLM, seed: int = 0) -> None:
    """Replace `llm`'s model pass by zeros and table rows (see the docstring)."""
    model = llm.engine.runner.model
    hidden_size = llm.engine.config.hidden_size
    table = torch.randn(997, WIDTH, generator=torch.Generator().manual_seed(seed)) * 6  # peaked, as a real model's
    state = {"step": 0}
    blocks: dict[int, list[torch.Tensor]] = {}  # rows -> 8 blocks of logits, gathered once (a gather a step
    # cost 0.25 ms at 64 rows: the stub's own time, a third of the step measured)

    def forward(input_ids, positions, kv, meta, tracer=None):
        return torch.zeros(input_ids.shape[0], hidden_size)

    def compute_logits(hidden):
        state["step"] += 1
        n = hidden.shape[0]
        if n not in blocks:
            blocks[n] = [table[(torch.arange(n) * 31 + k) % table.shape[0]] for k in range(8)]
        return blocks[n][state["step"] % 8].clone()  # (a fresh tensor, as a pass's: the sampler may write it)

    model.forward = forward
    model.compute_logits = compute_logits
    llm.engine.runner.native_decoder = None  # (the CPU's one-call C step: the whole pass)


def run(llm: LLM, seqs: int, tokens: int, params: SamplingParams) -> list[float]:
    """The milliseconds of each step whose decodes are all `seqs` sequences."""
    rng = random.Random(0)
    prompts = [[rng.randrange(100, WIDTH) for _ in range(32)] for _ in range(seqs)]
    steps: list[float] = []
    llm.engine.subscribe(lambda st: steps.append(st.ms) if not st.prefill and len(st.decode) == seqs else None)
    try:
        llm.generate(prompts, SamplingParams(**{**params.__dict__, "max_tokens": tokens}))
    finally:
        llm.engine.subscribers.pop()
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--seqs", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--tokens", type=int, default=200, help="new tokens a sequence")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--async", dest="async_scheduling", action="store_true", help="async scheduling (a GPU's default)")
    ap.add_argument("--profile", help="write cProfile's top functions of one greedy and one sampled run here")
    a = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM(a.model, dtype="float32", max_num_seqs=max(a.seqs), max_model_len=1024,
              async_scheduling=a.async_scheduling, kv_cache_memory=2 << 30, huge_pages=False)
    stub_pass(llm)
    kinds = {"greedy": SamplingParams(temperature=0, ignore_eos=True),
             "sampled": SamplingParams(temperature=0.8, top_p=0.95, seed=1, ignore_eos=True)}
    run(llm, 4, 8, kinds["greedy"])  # warm up
    print(f"{a.model}, async scheduling {'on' if a.async_scheduling else 'off'}, {a.tokens} tokens a sequence, "
          "median step ms (us a sequence)")
    for n in a.seqs:
        for name, params in kinds.items():
            meds = [statistics.median(run(llm, n, a.tokens, params)) for _ in range(a.rounds)]
            print(f"  {n:4d} sequences {name:8s} " + "  ".join(f"{m:.3f} ({1e3 * m / n:.1f})" for m in meds))
    if a.profile:
        with open(a.profile, "w") as f:
            for name, params in kinds.items():
                prof = cProfile.Profile()
                prof.enable()
                t = time.perf_counter()
                run(llm, max(a.seqs), a.tokens, params)
                prof.disable()
                f.write(f"{name}: {time.perf_counter() - t:.2f} s\n")
                pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)


if __name__ == "__main__":
    main()
