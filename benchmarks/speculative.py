"""Speculative decoding benchmark: decode tokens/s of a target model alone, with a draft model,
and with n-gram (prompt lookup) proposals; single stream and batched; on chat prompts and on
code-editing prompts (whose answers repeat much of the prompt). Greedy, so every variant must
produce the very same tokens as the target alone (checked and printed).

    python benchmarks/speculative.py [--target M] [--draft M] [-k 4] [--batch 1 --batch 8]

Decode tokens/s counts the tokens after the first over the time after the first (prefill
excluded), summed over the batch. Each variant runs in this process, one after another.
"""

from __future__ import annotations

import argparse
import gc

from nextoken import LLM, SamplingParams

CODE = [
    ("Rename the function parse_config to load_settings and the variable config to settings.",
     '''def parse_config(path):
    config = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config
'''),
    ("Add type hints to every function.",
     '''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)


def stddev(values):
    return variance(values) ** 0.5
'''),
    ("Replace the print calls with logging.info calls and add the import.",
     '''def run(jobs):
    print("starting", len(jobs), "jobs")
    done = 0
    for job in jobs:
        print("running", job.name)
        job.run()
        done += 1
    print("finished", done, "jobs")
    return done
'''),
    ("Make the class a dataclass; keep every field and method.",
     '''class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def norm(self):
        return (self.x ** 2 + self.y ** 2) ** 0.5

    def scale(self, k):
        return Point(self.x * k, self.y * k)
'''),
]
CHAT = ["Explain what a hash table is, in a short paragraph.",
        "Give three tips for writing readable Python code.",
        "What is the difference between a process and a thread?",
        "Describe how binary search works."]


def prompts(llm: LLM, kind: str) -> list[str]:
    if kind == "code":
        msgs = [[{"role": "user", "content": f"{task} Reply with the whole code only.\n\n{code}"}] for task, code in CODE]
    else:
        msgs = [[{"role": "user", "content": q}] for q in CHAT]
    return [llm.render_chat(m) for m in msgs]


def run(llm: LLM, texts: list[str], batch: int, max_tokens: int):
    """Decode tok/s (after the first token of each request) and the token ids, batch at a time."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate([texts[0]], SamplingParams(temperature=0, max_tokens=2))  # warm the kernels
    ids, tokens, seconds = [], 0, 0.0
    for i in range(0, len(texts), batch):
        outs = llm.generate(texts[i : i + batch], params)
        first = min(o.metrics.first_token_time for o in outs)
        last = max(o.metrics.finished_time for o in outs)
        tokens += sum(len(o.outputs[0].token_ids) - 1 for o in outs)
        seconds += last - first
        ids += [o.outputs[0].token_ids for o in outs]
    return tokens / seconds, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--kinds", default="code,chat")
    ap.add_argument("--variants", default="draft,ngram", help="which of draft,ngram to run after the target alone")
    ap.add_argument("--draft-vocab", type=int, action="append",
                    help="the draft's head size (--speculative-draft-vocab; repeat to compare, 0: the whole head); "
                         "default: the engine's")
    a = ap.parse_args()
    batches = a.batch or [1, 8]
    chosen = a.variants.split(",")
    variants = [("target alone", {})] + \
        ([(f"+ draft {a.draft}" + (f" (head {v or 'whole'})" if v is not None else ""),
           {"speculative_model": a.draft, **({} if v is None else {"speculative_draft_vocab": v})})
          for v in (a.draft_vocab or [None])] if "draft" in chosen else []) + \
        ([("+ n-gram", {"speculative_method": "ngram"})] if "ngram" in chosen else [])
    print(f"target {a.target}, k={a.num_speculative_tokens}, greedy, max_tokens {a.max_tokens}")
    print("| prompts | batch | variant | decode tok/s | speed-up | acceptance | tokens per step | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in batches:
        base = {}
        for name, kw in variants:
            extra = {"num_speculative_tokens": a.num_speculative_tokens} if kw else {}
            llm = LLM(a.target, max_num_seqs=batch, max_model_len=2048, dense_weights=False, **kw, **extra)
            for kind in a.kinds.split(","):
                texts = prompts(llm, kind) * (2 if batch > len(CODE) else 1)
                texts = texts[: max(batch, len(CODE))]
                speed, ids = run(llm, texts, batch, a.max_tokens)
                st = llm.engine.stats()
                if not kw:
                    base[kind] = (speed, ids)
                b_speed, b_ids = base[kind]
                acc = f"{st['spec_acceptance_rate']:.2f}" if kw else "-"
                per = f"{st['spec_mean_accepted_length']:.2f}" if kw else "-"
                print(f"| {kind} | {batch} | {name} | {speed:.1f} | {speed / b_speed:.2f}x | {acc} | {per} | "
                      f"{'yes' if ids == b_ids else 'NO'} |", flush=True)
                if llm.engine.speculator is not None:
                    llm.engine.speculator.reset_counts()
            del llm
            gc.collect()


if __name__ == "__main__":
    main()
