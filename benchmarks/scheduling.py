"""Scheduling for many users (issue 65): priorities, beam search under load, fair sharing.

    python benchmarks/scheduling.py                       # Qwen2.5-Coder-0.5B, every scenario
    python benchmarks/scheduling.py --scenario priority --runs 3

Each scenario starts `nextoken serve` itself (2 threads, ``--max-num-seqs 16``) and talks to it
with httpx as a client would:

- priority: 32 background completions of 256 tokens at priority 10 (16 run, 16 wait), then a
  priority-0 and a priority-10 chat request of 16 tokens sent at the same moment; their times to
  first token (streamed), and their ratio (the issue's bar: <= 0.2).
- beam: a beam search (width 3, 64 tokens, priority 0) alone, then under the same background load
  (priority 10); the ratio of its times (bar: <= 4). beam-fcfs: the same at equal priority under
  first come, first served (the search waits its turn behind the 16 waiting requests).
- fair: ``--scheduling-policy fair``; client A (``user``) keeps 48 requests in flight, client B
  one (it sends its next when one ends), all of 32 tokens; each client's tokens while both are
  active, B's share, and the median latency of B's requests. fair-fcfs: the same under first
  come, first served. (With 16 sequence slots, one request in flight can hold 1 of them: B's
  share is bounded by what one stream takes; fairness shows in B's requests not waiting.)
- throughput: 48 completions of 128 tokens, all at priority 0, under ``fcfs`` and under
  ``priority`` (bar: within 5%).

Greedy background requests (``temperature`` 0, ``ignore_eos``); the timed ones greedy too.
Prints one line per run and the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import httpx

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from serve import launch  # noqa: E402


def completion(prompt: str, max_tokens: int, priority: int = 0, **extra) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "priority": priority, **extra}


async def ttft_chat(client, priority: int) -> float:
    body = {"model": "m", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16,
            "temperature": 0, "stream": True, "priority": priority}
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    return time.perf_counter() - t0
    return float("nan")


async def background(client, n: int, max_tokens: int, priority: int) -> list[asyncio.Task]:
    tasks = [asyncio.create_task(client.post("/v1/completions", json=completion(
        f"Write a long story about the number {i}.", max_tokens, priority))) for i in range(n)]
    await asyncio.sleep(3.0)  # admitted and running: 16 decode, 16 wait
    return tasks


async def beam(client) -> float:
    t0 = time.perf_counter()
    r = await client.post("/v1/completions", json=completion("The three best ways to learn a language are",
                                                             64, use_beam_search=True, best_of=3, n=1))
    r.raise_for_status()
    return time.perf_counter() - t0


async def scenario_priority(url: str) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=httpx.Limits(max_connections=100)) as c:
        bg = await background(c, 32, 256, 10)
        hi, lo = await asyncio.gather(ttft_chat(c, 0), ttft_chat(c, 10))
        for t in bg:
            t.cancel()
        return {"ttft_p0_s": hi, "ttft_p10_s": lo, "ratio": hi / lo}


async def scenario_beam(url: str, background_priority: int = 10) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=httpx.Limits(max_connections=100)) as c:
        alone = await beam(c)
        bg = await background(c, 32, 256, background_priority)
        loaded = await beam(c)
        for t in bg:
            t.cancel()
        return {"alone_s": alone, "loaded_s": loaded, "ratio": loaded / alone}


async def scenario_fair(url: str) -> dict:
    tokens, b_latency = {"A": 0, "B": 0}, []
    stop = asyncio.Event()

    async def one(c, client: str, i: int):
        t0 = time.perf_counter()
        r = await c.post("/v1/completions", json=completion(f"Story {client}{i}:", 32, user=client))
        if not stop.is_set():
            tokens[client] += r.json()["usage"]["completion_tokens"]
            if client == "B":
                b_latency.append(time.perf_counter() - t0)

    async with httpx.AsyncClient(base_url=url, timeout=None, limits=httpx.Limits(max_connections=100)) as c:
        a_tasks = [asyncio.create_task(one(c, "A", i)) for i in range(48)]

        async def b_loop():
            i = 0
            while not stop.is_set():
                await one(c, "B", i)
                i += 1

        b = asyncio.create_task(b_loop())
        while sum(t.done() for t in a_tasks) < 40:  # both active until A's queue runs low
            await asyncio.sleep(0.2)
        stop.set()
        for t in a_tasks:
            t.cancel()
        b.cancel()
    return {**tokens, "share_b": tokens["B"] / max(1, tokens["A"] + tokens["B"]),
            "b_latency_s": statistics.median(b_latency) if b_latency else float("nan")}


async def scenario_throughput(url: str) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=httpx.Limits(max_connections=100)) as c:
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(c.post("/v1/completions", json=completion(f"Count from {i}.", 128))
                                    for i in range(48)))
        n = sum(r.json()["usage"]["completion_tokens"] for r in rs)
        return {"tok_s": n / (time.perf_counter() - t0)}


SCENARIOS = {"priority": ("priority", scenario_priority), "beam": ("priority", scenario_beam),
             "beam-fcfs": ("fcfs", lambda url: scenario_beam(url, 0)),
             "fair": ("fair", scenario_fair), "fair-fcfs": ("fcfs", scenario_fair), "throughput-fcfs": ("fcfs", scenario_throughput),
             "throughput-priority": ("priority", scenario_throughput)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--scenario", choices=list(SCENARIOS), action="append")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--port", type=int, default=8123)
    a = ap.parse_args()
    for name in a.scenario or list(SCENARIOS):
        policy, fn = SCENARIOS[name]
        rows = []
        for run in range(a.runs):
            proc, url = launch(a.model, a.port, ["--threads", "2", "--served-model-name", "m", "--max-num-seqs", "16",
                                                 "--scheduling-policy", policy, "--no-inspect"])
            try:
                row = asyncio.run(fn(url))
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            rows.append(row)
            print(name, run, {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(name, "median", {k: round(v, 3) for k, v in med.items()}, flush=True)


if __name__ == "__main__":
    main()
