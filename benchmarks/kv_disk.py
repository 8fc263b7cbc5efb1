"""The prefix cache's disk tier: TTFT of a long prompt cold, after a restart, and on a second
replica, and throughput with the tier on and off on a workload without shared prefixes.

    python benchmarks/kv_disk.py                         # Qwen2.5-Coder-1.5B, 4,096 tokens, 2 threads
    python benchmarks/kv_disk.py --model smollm2-135m-instruct --prompt-tokens 1024   # quick

1. restart: `nextoken serve --kv-cache-dir D` (fresh D); the prompt (random token ids, fixed
   seed) with ``max_tokens`` 1: the cold TTFT. Once the server has written its blocks, it is
   stopped (SIGTERM) and started again on D; the same prompt: the TTFT after a restart.
2. replicas: `nextoken serve --replicas 2` (one shared directory, one core each); the prompt to
   replica 1 (cold), then to replica 2, which reads replica 1's blocks back.
3. throughput: offline `LLM.generate` of `--requests` random prompts (no shared prefix) with the
   tier off and on, alternating, `--rounds` times each; the best of each is quoted. Greedy and
   sampled (temperature 1.0).

TTFT is measured at the client: request sent to the first streamed token.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

import httpx


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n)]


def start(args, port: int, kv_dir: str, extra: list[str] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nextoken", "serve", "--model", args.model, "--port", str(port),
           "--max-model-len", str(args.prompt_tokens + 64), "--max-num-seqs", "4", "--kv-cache-dir", kv_dir,
           "--log-level", "warning", *extra]
    if "--replicas" not in extra:
        cmd += ["--threads", str(args.threads)]
    p = subprocess.Popen(cmd, start_new_session=True)
    ports = [port] + ([port + 1, port + 2] if "--replicas" in extra else [])
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            if all(httpx.get(f"http://127.0.0.1:{q}/health", timeout=2).status_code == 200 for q in ports):
                return p
        except httpx.HTTPError:
            pass
        if p.poll() is not None:
            raise SystemExit(f"server exited with {p.returncode}")
        time.sleep(0.5)
    raise SystemExit("server did not start")


def stop(p: subprocess.Popen) -> None:
    os.killpg(p.pid, signal.SIGTERM)
    p.wait(timeout=120)


def ttft(url: str, ids: list[int]) -> float:
    """Seconds from sending `ids` to the first streamed token (after a short request of other
    tokens, so that both servers compared have served one)."""
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt_ids(16, seed=99), "max_tokens": 2},
               timeout=600).raise_for_status()
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True}
    t = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"]:
                return time.perf_counter() - t
    raise RuntimeError("no token streamed")


def metric(url: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics", timeout=10).text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def wait_written(url: str) -> float:
    """Wait until the server's disk writes stop growing; the bytes written."""
    last = -1.0
    while True:
        now = metric(url, "nextoken_kv_disk_written_bytes_total")
        if now > 0 and now == last:
            return now
        last = now
        time.sleep(1.0)


def bench_restart(args) -> dict:
    ids = prompt_ids(args.prompt_tokens)
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        url = f"http://127.0.0.1:{args.port}"
        p = start(args, args.port, d)
        try:
            cold = ttft(url, ids)
            written = wait_written(url)
        finally:
            stop(p)
        p = start(args, args.port, d)
        try:
            warm = ttft(url, ids)
            hits = metric(url, "vllm:external_prefix_cache_hits_total")
        finally:
            stop(p)
    return {"cold_ttft_s": cold, "restart_ttft_s": warm, "ratio": warm / cold, "bytes_written": written,
            "tokens_read_back": hits}


def bench_replicas(args) -> dict:
    ids = prompt_ids(args.prompt_tokens, seed=1)
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        p = start(args, args.port, d, ["--replicas", "2"])
        r1, r2 = (f"http://127.0.0.1:{args.port + i}" for i in (1, 2))
        try:
            cold = ttft(r1, ids)
            wait_written(r1)
            second = ttft(r2, ids)
            hits = metric(r2, "vllm:external_prefix_cache_hits_total")
        finally:
            stop(p)
    return {"cold_ttft_s": cold, "second_replica_ttft_s": second, "ratio": second / cold, "tokens_read_back": hits}


def bench_throughput(args) -> dict:
    from nextoken import LLM, SamplingParams

    rng = random.Random(2)
    prompts = [[rng.randrange(1000, 30000) for _ in range(args.throughput_prompt)] for _ in range(args.requests)]
    out = {}
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        llms = {"off": LLM(args.model, num_threads=args.threads, max_num_seqs=args.requests,
                           max_model_len=args.throughput_prompt + args.throughput_output + 16),
                "on": LLM(args.model, num_threads=args.threads, max_num_seqs=args.requests, kv_cache_dir=d,
                          max_model_len=args.throughput_prompt + args.throughput_output + 16)}
        for llm in llms.values():  # first-use costs (the cache's pages, the kernels' buffers) out of the timing
            llm.generate([[rng.randrange(1000, 30000) for _ in range(args.throughput_prompt)]] * 2,
                         SamplingParams(max_tokens=8))
        for t_index, temperature in enumerate((0.0, 1.0)):
            params = SamplingParams(temperature=temperature, max_tokens=args.throughput_output, ignore_eos=True,
                                    seed=0)
            best = {"off": 0.0, "on": 0.0}
            for r in range(args.rounds):
                for name, llm in llms.items():
                    salt = 7919 * (1 + r + args.rounds * t_index)  # every round and mode: prompts never seen
                    shifted = [[(t + salt * (i + 1)) % 29000 + 1000 for t in p] for i, p in enumerate(prompts)]
                    t = time.perf_counter()
                    llm.generate(shifted, params)
                    dt = time.perf_counter() - t
                    tokens = len(prompts) * (args.throughput_prompt + args.throughput_output)
                    best[name] = max(best[name], tokens / dt)
            mode = "greedy" if temperature == 0 else "sampled"
            out[mode] = {"off_tok_s": best["off"], "on_tok_s": best["on"], "on_over_off": best["on"] / best["off"]}
        out["blocks_written"] = llms["on"].engine.stats()["kv_disk_blocks_written"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=8390)
    ap.add_argument("--requests", type=int, default=16, help="throughput: requests per round")
    ap.add_argument("--throughput-prompt", type=int, default=256)
    ap.add_argument("--throughput-output", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tmp", default=None, help="where the tier's directories go (default: the system's temp)")
    ap.add_argument("--only", choices=["restart", "replicas", "throughput"], action="append")
    args = ap.parse_args()
    parts = {"restart": bench_restart, "replicas": bench_replicas, "throughput": bench_throughput}
    results = {}
    for name in args.only or parts:
        results[name] = parts[name](args)
        print(name, json.dumps(results[name], indent=1), flush=True)
    print(json.dumps({"model": args.model, "prompt_tokens": args.prompt_tokens, "threads": args.threads, **results}))


if __name__ == "__main__":
    main()
