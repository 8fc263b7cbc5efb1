"""Serving throughput with the inspector's page open against without it.

    python benchmarks/page_open.py                      # SmolLM2, 3 alternations, greedy and sampled
    python benchmarks/page_open.py --views 4 --rounds 5

Starts `nextoken serve --no-prefix-caching` itself (so every run computes the same prompts), warms
it up, then alternates runs without and with `--views` open pages. An open page's steady load is
its live view: the ``/inspect/api/live`` event stream, four snapshots a second read between engine
steps (`benchmarks/serve.py`'s `LiveView`). Each run sends the same `--num-requests` requests at
once (random token-id prompts of 32-256 tokens, 16-128 output tokens, `ignore_eos`, streamed) and
counts output tokens per second of wall time. Prints each run, then the median of each cell and
the ratio with the page open to without.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import random
import statistics
from pathlib import Path

import httpx

spec = importlib.util.spec_from_file_location("serve_bench", Path(__file__).resolve().parent / "serve.py")
serve_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serve_bench)


def workload(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(100, 40000) for _ in range(rng.randint(32, 256))], rng.randint(16, 128)) for _ in range(n)]


def output_rate(url: str, model: str, reqs, temperature: float) -> float:
    results, wall = asyncio.run(serve_bench.run_rate(url, model, 1e6, reqs, 0, temperature))
    failed = [r["error"] for r in results if "error" in r]
    if failed:
        raise SystemExit(f"requests failed: {sorted(set(failed))}")
    return sum(r["out"] for r in results) / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--views", type=int, default=1, help="pages open during the 'open' runs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--port", type=int, default=8321)
    a = ap.parse_args()
    proc, url = serve_bench.launch(a.model, a.port, ["--no-prefix-caching"])
    try:
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        reqs = workload(a.num_requests, 7)
        output_rate(url, model, workload(16, 99), 0.0)  # warm-up
        cells: dict[tuple[str, str], list[float]] = {}
        for r in range(a.rounds):
            for page in ("closed", "open"):
                for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
                    views = [serve_bench.LiveView(url) for _ in range(a.views if page == "open" else 0)]
                    rate = output_rate(url, model, reqs, temperature)
                    events = sum(v.stop() for v in views)
                    cells.setdefault((page, name), []).append(rate)
                    print(f"round {r + 1}, page {page}, {name}: {rate:.1f} output tok/s"
                          + (f" ({events} live events)" if views else ""), flush=True)
        for name in ("greedy", "sampled"):
            closed, opened = statistics.median(cells["closed", name]), statistics.median(cells["open", name])
            print(f"{a.model}, {name}, {a.num_requests} requests at once: page closed {closed:.1f} tok/s, "
                  f"{a.views} open {opened:.1f} tok/s ({100 * (opened / closed - 1):+.1f}%)")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
