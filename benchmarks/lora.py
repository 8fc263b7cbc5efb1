"""LoRA throughput: requests spread over adapters against the base model alone, at a batch and
for one user.

    python benchmarks/lora.py       # SmolLM2: 32 requests on 4 rank-16 adapters; 1 request on 1

The adapters are PEFT folders with random A and B for every projection (q, k, v, o, gate, up,
down) of every layer, written by this script for the model's shapes (read from the GGUF). Each
workload: `--requests` random prompts of `--prompt` tokens and `--output` tokens each
(`ignore_eos`), greedy and sampled (temperature 1.0), all in one `generate` call: with the base
model for every request, then with request i on adapter i % `--adapters`; then one request
alone, base and on one adapter. Base and adapter runs alternate (this VM's speed drifts).
Reported: total tokens/s (prompt + output), best of `--rounds`, and the median of the rounds'
ratios (each round runs base then adapters, back to back).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch


def write_adapters(d: Path, cfg, n: int, rank: int) -> list[Path]:
    from safetensors.torch import save_file

    h, kv, ffn = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    q = cfg.num_heads * cfg.head_dim
    shapes = {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
              "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, ffn), "mlp.up_proj": (h, ffn), "mlp.down_proj": (ffn, h)}
    out = []
    for a in range(n):
        g = torch.Generator().manual_seed(a)
        tensors = {}
        for layer in range(cfg.num_layers):
            for name, (i, o) in shapes.items():
                key = f"base_model.model.model.layers.{layer}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, i, generator=g) / i ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(o, rank, generator=g) * 0.01
        p = d / f"adapter{a}"
        p.mkdir()
        save_file(tensors, str(p / "adapter_model.safetensors"))
        (p / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 2 * rank, "target_modules": [
            s.split(".")[1] for s in shapes]}))
        out.append(p)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from nextoken import LLM, LoRARequest, SamplingParams

    llm = LLM(args.model, num_threads=args.threads, max_num_seqs=args.requests, enable_lora=True,
              max_loras=args.adapters, max_lora_rank=args.rank, enable_prefix_caching=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt)] for _ in range(args.requests)]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_adapters(Path(tmp), llm.config, args.adapters, args.rank)
        loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        workloads = {f"batch {args.requests}, {args.adapters} adapters": (prompts, [
            loras[i % len(loras)] for i in range(args.requests)]), "batch 1, 1 adapter": (prompts[:1], loras[:1])}
        llm.generate(prompts[:4], SamplingParams(max_tokens=4), lora_request=[loras[i % len(loras)] for i in range(4)])
        for workload, (batch, per_request) in workloads.items():
            tokens = len(batch) * (args.prompt + args.output)
            for temperature in (0.0, 1.0):
                params = SamplingParams(temperature=temperature, max_tokens=args.output, ignore_eos=True, seed=0)
                best, ratios = {"base": 0.0, "lora": 0.0}, []
                for _ in range(args.rounds):
                    rate = {}
                    for name, lr in (("base", None), ("lora", per_request)):
                        t = time.perf_counter()
                        llm.generate(batch, params, lora_request=lr)
                        rate[name] = tokens / (time.perf_counter() - t)
                        best[name] = max(best[name], rate[name])
                    ratios.append(rate["lora"] / rate["base"])
                mode = "greedy" if temperature == 0 else "sampled"
                ratio = statistics.median(ratios)
                results[f"{workload}, {mode}"] = {"base_tok_s": best["base"], "lora_tok_s": best["lora"], "ratio": ratio}
                print(f"{workload:22} {mode:8} base {best['base']:8.1f} tok/s   with adapters {best['lora']:8.1f} "
                      f"tok/s   median ratio {ratio:.2f}x", flush=True)
    print(json.dumps({"model": args.model, "requests": args.requests, "adapters": args.adapters, "rank": args.rank,
                      **results}))


if __name__ == "__main__":
    main()
