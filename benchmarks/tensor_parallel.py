"""One process, tensor parallel, or replicas: decode speed at batch 1 and at batch B.

    python benchmarks/tensor_parallel.py --model qwen2.5-coder-1.5b-instruct [--batch 32]
        [--tokens 128] [--prompt-tokens 128] [--size 2]

Each setup runs in a fresh process (the pinning of one does not leak into the next), back to
back on the same machine:

- ``one``: one process on every core (``--threads`` = cores);
- ``tp``: ``tensor_parallel_size=size``; rank 0 spawns the others, each rank pinned to its
  slice of the cores. Also the all-reduce and all-gather time per call (rank 0's view: it
  includes waiting for the slower rank);
- ``replicas``: `size` independent processes, each pinned to its slice and running
  ``batch / size`` of the requests at the same time (what ``nextoken serve --replicas`` does
  behind the router; batch 1 runs on one replica: a single request cannot use two).

Decode tok/s at batch 1 is one request's output tokens after the first over the time after
its first token (1 / TPOT); at batch B it is all output tokens over the wall time of the
whole batch (prefill included, as a server would see it). Greedy, ``ignore_eos``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def run_setup(args) -> dict:
    """In the child process: load, warm up, measure batch 1 and batch B; print JSON."""
    from nextoken import LLM, SamplingParams

    opts = dict(max_model_len=args.prompt_tokens + args.tokens + 16, max_num_seqs=max(args.batch, 1))
    if args.setup == "tp":
        opts["tensor_parallel_size"] = args.size
    if args.threads:
        opts["num_threads"] = args.threads
    t0 = time.perf_counter()
    llm = LLM(args.model, **opts)
    load = time.perf_counter() - t0
    vocab = llm.config.vocab_size
    prompts = [[(1000 + 37 * i + 11 * j) % vocab for j in range(args.prompt_tokens)] for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    out = {"load_s": load}
    tp = getattr(llm.runner, "tp", None)
    if args.batch_one:
        before = {k: list(v) for k, v in tp.stats.items()} if tp else None
        m = llm.generate(prompts[:1], params)[0].metrics
        out["batch1_decode_tok_s"] = 1 / m.tpot
        if tp:
            steps = tp.stats["broadcast"][0] - before["broadcast"][0]
            for kind in ("all_reduce", "all_gather"):
                calls = tp.stats[kind][0] - before[kind][0]
                out[f"{kind}_ms_per_call"] = 1e3 * (tp.stats[kind][1] - before[kind][1]) / calls
                out[f"{kind}_calls_per_step"] = calls / steps
    if args.batch_share:
        before = {k: list(v) for k, v in tp.stats.items()} if tp else None
        t0 = time.perf_counter()
        res = llm.generate(prompts[: args.batch_share], params)
        out["batch_wall_s"] = time.perf_counter() - t0
        out["batch_tokens"] = sum(len(r.outputs[0].token_ids) for r in res)
        if tp:
            calls = tp.stats["all_reduce"][0] - before["all_reduce"][0]
            out["batch_all_reduce_ms_per_call"] = 1e3 * (tp.stats["all_reduce"][1] - before["all_reduce"][1]) / calls
    if tp:
        llm.close()
    return out


def child(setup: str, args, batch_one: bool, share: int, cores: str | None = None, threads: int | None = None):
    cmd = [sys.executable, __file__, "--child", setup, "--model", args.model, "--batch", str(args.batch),
           "--tokens", str(args.tokens), "--prompt-tokens", str(args.prompt_tokens), "--size", str(args.size),
           "--batch-share", str(share)] + (["--batch-one"] if batch_one else []) + \
          (["--threads", str(threads)] if threads else [])
    if cores is not None:
        cmd = ["taskset", "-c", cores] + cmd
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def result(p) -> dict:
    out, _ = p.communicate()
    if p.returncode:
        raise SystemExit(f"a setup failed with status {p.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--size", type=int, default=2)
    ap.add_argument("--child", choices=("one", "tp", "replica"))
    ap.add_argument("--batch-one", action="store_true")
    ap.add_argument("--batch-share", type=int, default=0)
    ap.add_argument("--threads", type=int)
    args = ap.parse_args()
    if args.child:
        args.setup = args.child
        print(json.dumps(run_setup(args)), flush=True)
        return
    cores = sorted(os.sched_getaffinity(0))
    k = len(cores) // args.size
    slices = [",".join(map(str, cores[i * k:(i + 1) * k])) for i in range(args.size)]
    rows = {}
    rows["one process"] = result(child("one", args, True, args.batch))
    rows[f"tensor parallel {args.size}"] = result(child("tp", args, True, args.batch))
    reps = [child("replica", args, i == 0, args.batch // args.size, slices[i], k) for i in range(args.size)]
    outs = [result(p) for p in reps]
    rows[f"{args.size} replicas"] = {"batch1_decode_tok_s": outs[0]["batch1_decode_tok_s"],
                                     "batch_wall_s": max(o["batch_wall_s"] for o in outs),
                                     "batch_tokens": sum(o["batch_tokens"] for o in outs),
                                     "load_s": max(o["load_s"] for o in outs)}
    print(f"{args.model}: {len(cores)} cores, prompts of {args.prompt_tokens} tokens, {args.tokens} output tokens")
    print(f"{'setup':22} {'load s':>7} {'decode tok/s, batch 1':>22} {f'output tok/s, batch {args.batch}':>24}")
    for name, r in rows.items():
        print(f"{name:22} {r['load_s']:7.2f} {r['batch1_decode_tok_s']:22.1f} "
              f"{r['batch_tokens'] / r['batch_wall_s']:24.1f}")
    tp = rows[f"tensor parallel {args.size}"]
    print(f"tensor parallel, batch 1: {tp['all_reduce_calls_per_step']:.0f} all-reduces per step, "
          f"{tp['all_reduce_ms_per_call']:.3f} ms each; {tp['all_gather_calls_per_step']:.0f} all-gather "
          f"(the head), {tp['all_gather_ms_per_call']:.3f} ms; batch {args.batch}: "
          f"{tp['batch_all_reduce_ms_per_call']:.3f} ms per all-reduce")


if __name__ == "__main__":
    main()
