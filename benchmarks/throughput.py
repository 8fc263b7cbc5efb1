"""Offline throughput: many requests through the engine, optionally against `transformers`.

    python benchmarks/throughput.py                       # 64 requests on SmolLM2 (bf16)
    python benchmarks/throughput.py --compare transformers --single 4

Workload (fixed seed): random prompts of 64..512 token ids and 64..256 output tokens each,
`ignore_eos` so every request produces exactly its output length. Reports output tokens/s and
total (prompt + output) tokens/s. `--compare transformers` runs the same workload through
`transformers` `generate` on the same GGUF weights, in padded static batches of
`--hf-batch-size` (left padding; each batch decodes until its longest request is done, and only
the requested tokens count). `--single N` also times N requests one at a time, for scale.
"""

from __future__ import annotations

import argparse
import random
import resource
import time

import torch


def workload(args, vocab_size: int, special: set[int]):
    rng = random.Random(args.seed)
    normal = [t for t in range(vocab_size) if t not in special]
    reqs = []
    for _ in range(args.num_requests):
        p = rng.randint(args.min_prompt, args.max_prompt)
        o = rng.randint(args.min_output, args.max_output)
        reqs.append(([rng.choice(normal) for _ in range(p)], o))
    return reqs


def run_nextoken(llm, reqs) -> float:
    from nextoken import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params)
    dt = time.perf_counter() - t
    assert [len(o.outputs[0].token_ids) for o in outs] == [o for _, o in reqs]
    return dt


def run_transformers(path, dtype, reqs, batch_size: int) -> float:
    """The same GGUF weights de-quantized to dense `dtype` tensors, as nextoken uses them."""
    from transformers import AutoModelForCausalLM, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype,
        quantization_config=GgufConfig(gguf_file=path.name, dequantize=True)).eval()
    print(f"  transformers {__import__('transformers').__version__}, weights {model.dtype}, "
          f"attention {model.config._attn_implementation}")
    pad = 0
    t = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        new = max(o for _, o in batch)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)
    return time.perf_counter() - t


def report(name, dt, reqs):
    n_in = sum(len(p) for p, _ in reqs)
    n_out = sum(o for _, o in reqs)
    print(f"{name:<34} {dt:8.1f} s   output {n_out / dt:8.1f} tok/s   total {(n_in + n_out) / dt:8.1f} tok/s")
    return (n_in + n_out) / dt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--min-output", type=int, default=64)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--compare", choices=["transformers"], default=None)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--single", type=int, default=0, help="also time this many requests one at a time")
    ap.add_argument("--dense-weights", action=argparse.BooleanOptionalAction, default=None,
                    help="keep bf16 copies of quantized weights (default: the engine's, on for several sequences)")
    args = ap.parse_args()

    from nextoken import LLM
    from nextoken.cli_args import parse_size

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=parse_size(args.kv_cache_memory),
              dense_weights=bool(args.dense_weights))
    reqs = workload(args, llm.config.vocab_size, llm.tokenizer.special_ids)
    print(f"model {args.model} ({args.dtype}), {len(reqs)} requests, prompts {args.min_prompt}-{args.max_prompt}, "
          f"outputs {args.min_output}-{args.max_output}, torch threads {torch.get_num_threads()}")
    run_nextoken(llm, reqs[:2])  # warm-up
    ours = report("nextoken (continuous batching)", run_nextoken(llm, reqs), reqs)
    print(f"  peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB, "
          f"preemptions {llm.engine.stats()['num_preemptions']}")
    if args.single:
        few = reqs[: args.single]
        dt = sum(run_nextoken(llm, [r]) for r in few)
        report(f"nextoken one at a time ({len(few)} reqs)", dt, few)
    if args.compare == "transformers":
        dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
        theirs = report(f"transformers static batch {args.hf_batch_size}",
                        run_transformers(llm.model_path, dtype, reqs, args.hf_batch_size), reqs)
        print(f"ratio nextoken / transformers (total tokens/s): {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
