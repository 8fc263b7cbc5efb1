"""Online serving benchmark, in the spirit of vLLM's benchmark_serving.

    python benchmarks/serve.py --rate 0.5 --rate 3        # starts `nextoken serve` itself
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --rate 2

Requests arrive as a Poisson process at each `--rate` (requests/s), with random prompt (token
ids) and output lengths from a fixed seed, streamed from /v1/completions with `ignore_eos`, greedy
or at `--temperature` (run both: users sample).
Reports TTFT, TPOT (per request, after the first token), ITL (between streamed chunks) and
end-to-end latency (mean, p50, p99), request and token throughput, and errors.
"""

from __future__ import annotations

import argparse
import threading
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

import httpx


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def one(client, model, prompt, out_len, temperature):
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": temperature, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, itl, last, n_out = None, [], None, 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    n_out = chunk["usage"]["completion_tokens"]
                elif chunk.get("choices") and chunk["choices"][0]["text"]:
                    if ttft is None:
                        ttft = now - t0
                    else:
                        itl.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        return {"error": type(exc).__name__}
    e2e = time.perf_counter() - t0
    tpot = (e2e - ttft) / (n_out - 1) if ttft is not None and n_out > 1 else None
    return {"ttft": ttft, "itl": itl, "e2e": e2e, "tpot": tpot, "out": n_out, "in": len(prompt)}


async def run_rate(base_url, model, rate, reqs, seed, temperature):
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=600,
                                 limits=httpx.Limits(max_connections=1000, max_keepalive_connections=1000)) as c:
        t0 = time.perf_counter()
        tasks = []
        for prompt, out_len in reqs:
            tasks.append(asyncio.create_task(one(c, model, prompt, out_len, temperature)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def summarize(rate, results, wall, temperature):
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    line = lambda name, xs, unit=1000: (f"  {name:<5} mean {statistics.fmean(xs) * unit:8.1f}  p50 {pct(xs, 50) * unit:8.1f}"
                                        f"  p99 {pct(xs, 99) * unit:8.1f} ms" if xs else f"  {name:<5} n/a")
    print(f"rate {rate} req/s, temperature {temperature}: {len(ok)} ok, {len(errors)} errors {sorted(set(errors)) or ''}, wall {wall:.1f} s")
    print(f"  throughput {len(ok) / wall:.2f} req/s, output {sum(r['out'] for r in ok) / wall:.1f} tok/s, "
          f"total {sum(r['out'] + r['in'] for r in ok) / wall:.1f} tok/s")
    print(line("TTFT", [r["ttft"] for r in ok if r["ttft"] is not None]))
    print(line("TPOT", [r["tpot"] for r in ok if r["tpot"] is not None]))
    print(line("ITL", [x for r in ok for x in r["itl"]]))
    print(line("E2E", [r["e2e"] for r in ok]))


def launch(model, port, extra):
    cmd = [sys.executable, "-m", "nextoken.cli", "serve", "--model", model, "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become healthy")


class LiveView:
    """One open inspector page's worth of live traffic: reads /inspect/api/live in a thread."""

    def __init__(self, url):
        self.events, self.done = 0, threading.Event()
        self.thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self.thread.start()

    def _read(self, url):
        with httpx.stream("GET", url + "/inspect/api/live", timeout=None) as r:
            for line in r.iter_lines():
                self.events += line.startswith("data: ")
                if self.done.is_set():
                    return

    def stop(self) -> int:
        self.done.set()
        return self.events


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="an already running server (default: launch one)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rate", type=float, action="append", help="requests per second (repeatable)")
    ap.add_argument("--num-requests", type=int, default=40)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-token-id", type=int, default=40000,
                    help="prompts are random token ids in [100, this) (a tiny test model: its vocabulary's size)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="every request's temperature (0: greedy; the API's default is 1.0)")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--server-args", default="", help="extra arguments for `nextoken serve`")
    ap.add_argument("--live-views", type=int, default=0,
                    help="keep N inspector live views open during the run (/inspect/api/live event streams)")
    args = ap.parse_args()
    proc = None
    url = args.base_url
    if url is None:
        proc, url = launch(args.model, args.port, args.server_args.split())
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    views = [LiveView(url) for _ in range(args.live_views)]
    try:
        for k, rate in enumerate(args.rate or [1.0]):
            rng = random.Random(args.seed + k)
            reqs = [([rng.randrange(min(100, args.max_token_id - 1), args.max_token_id) for _ in range(rng.randint(args.min_prompt, args.max_prompt))],
                     rng.randint(args.min_output, args.max_output)) for _ in range(args.num_requests)]
            results, wall = asyncio.run(run_rate(url, model, rate, reqs, args.seed + k, args.temperature))
            summarize(rate, results, wall, args.temperature)
    finally:
        for v in views:
            print(f"  live view: {v.stop()} events received")
        if proc is not None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
