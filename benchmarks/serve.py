"""Online serving benchmark, in the spirit of vLLM's benchmark_serving.

    python benchmarks/serve.py --rate 0.5 --rate 3        # starts `nextoken serve` itself
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --rate 2

Requests arrive as a Poisson process at each `--rate` (requests/s), with random prompt (token
ids; after a shared beginning of `--prefix-len` tokens) and output lengths from a fixed seed, streamed from /v1/completions with `ignore_eos`, greedy
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


async def event_lines(response):
    """The lines of a server-sent event stream, split at its line ends alone (LF, CR LF): httpx's
    ``aiter_lines`` also splits at U+2028, U+0085 and U+2029 (``str.splitlines``), which a
    server may send unescaped inside an event's JSON (SSE allows it; vLLM does), cutting it."""
    rest = ""
    async for text in response.aiter_text():
        *lines, rest = (rest + text).split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if rest:
        yield rest.removesuffix("\r")


async def one(client, model, prompt, out_len, temperature):
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": temperature, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, itl, last, n_out = None, [], None, 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}"}
            async for line in event_lines(r):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                try:
                    chunk = json.loads(line[6:])
                except ValueError:
                    return {"error": f"an event that is not JSON: {line[:60]!r}"}
                now = time.perf_counter()
                if chunk.get("error"):  # (the server's stream failed after its 200: an error event)
                    return {"error": f"error event: {str(chunk['error'].get('message'))[:80]}"}
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
    if not n_out:  # (no usage chunk: the stream ended before its end)
        return {"error": "the stream ended without its usage"}
    e2e = time.perf_counter() - t0
    tpot = (e2e - ttft) / (n_out - 1) if ttft is not None and n_out > 1 else None
    return {"ttft": ttft, "itl": itl, "e2e": e2e, "tpot": tpot, "out": n_out, "in": len(prompt)}


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which `n` requests arrive: a Poisson process at `rate`
    requests/s (all at once for an infinite rate) from `seed`."""
    rng, out, at = random.Random(seed), [], 0.0
    for _ in range(n):
        out.append(at)
        at += rng.expovariate(rate)
    return out


async def run_rate(base_url, model, rate, reqs, seed, temperature, start=None, offsets=None):
    """Send `reqs` ((prompt ids, output length) each) at `rate` requests/s (Poisson arrivals from
    `seed`; or at `offsets`, seconds after `start`, a `time.perf_counter()` value) and return
    (results, wall). The requests are spread over one `httpx.AsyncClient` per 16 of them: one
    pool of hundreds of connections spends most of the client's time matching requests to
    connections (its per-request scan is over every connection)."""
    if offsets is None:
        offsets = arrival_offsets(len(reqs), rate, seed)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    clients = [httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) for _ in range(max(1, -(-len(reqs) // 16)))]
    try:
        t0 = time.perf_counter() if start is None else start

        async def at(k, prompt, out_len):
            delay = t0 + offsets[k] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            return await one(clients[k % len(clients)], model, prompt, out_len, temperature)

        results = await asyncio.gather(*(at(k, p, n) for k, (p, n) in enumerate(reqs)))
        return results, time.perf_counter() - t0
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))


def default_client_procs() -> int:
    """Client processes for a load: the cores left after the server, its engine process and this
    one, two per process, at most 8 (one process on a small machine)."""
    return max(1, min(8, ((os.cpu_count() or 1) - 4) // 2))


def _load_worker(conn, base_url, model, reqs, offsets, temperature):
    """One client process of `run_load`: says it is ready, waits for the start time, sends its
    requests at their offsets, and returns (results, its CPU seconds)."""
    conn.send("ready")
    start = conn.recv()
    cpu = time.process_time()
    try:
        results, _ = asyncio.run(run_rate(base_url, model, None, reqs, 0, temperature, start=start, offsets=offsets))
    except Exception as exc:  # noqa: BLE001 - every request of this process gets the error, the load goes on
        results = [{"error": f"client process: {type(exc).__name__}: {exc}"}] * len(reqs)
    conn.send((results, time.process_time() - cpu))


def run_load(base_url, model, rate, reqs, seed, temperature, procs=1):
    """`run_rate` spread over `procs` client processes (request k goes to process k % procs, at
    the arrival time one process would give it), so that the client's Python (about 70 us a
    streamed chunk with httpx) does not set the pace of a fast server. Returns (results in the
    order of `reqs`, wall seconds from the first arrival to the last answer, the client's CPU
    seconds in all)."""
    if procs <= 1 or len(reqs) < 2:
        cpu = time.process_time()
        results, wall = asyncio.run(run_rate(base_url, model, rate, reqs, seed, temperature))
        return results, wall, time.process_time() - cpu
    import multiprocessing as mp

    offsets = arrival_offsets(len(reqs), rate, seed)
    ctx = mp.get_context("spawn")  # (the caller may hold a CUDA context: no fork)
    parts = [list(range(k, len(reqs), procs)) for k in range(procs)]
    pipes, workers = [], []
    for part in parts:
        here, there = ctx.Pipe()
        w = ctx.Process(target=_load_worker, daemon=True,
                        args=(there, base_url, model, [reqs[i] for i in part], [offsets[i] for i in part], temperature))
        w.start()
        there.close()  # (the worker's end only in the worker: its exit is then EOF here, not a wait forever)
        pipes.append(here)
        workers.append(w)
    try:
        for c in pipes:
            if c.recv() != "ready":
                raise RuntimeError("a client process did not start")
        start = time.perf_counter() + 0.1  # (the monotonic clock is the same in every process)
        for c in pipes:
            c.send(start)
        results, cpu = [None] * len(reqs), 0.0
        for part, c in zip(parts, pipes):
            try:
                got, spent = c.recv()
            except EOFError:  # the process died (killed, out of memory): its requests are errors
                got, spent = [{"error": "client process died"}] * len(part), 0.0
            cpu += spent
            for i, r in zip(part, got):
                results[i] = r
        return results, time.perf_counter() - start, cpu
    finally:
        for w in workers:
            w.join(timeout=10)
            if w.is_alive():
                w.kill()


def summarize(rate, results, wall, temperature, client_cpu=None, procs=1):
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    line = lambda name, xs, unit=1000: (f"  {name:<5} mean {statistics.fmean(xs) * unit:8.1f}  p50 {pct(xs, 50) * unit:8.1f}"
                                        f"  p99 {pct(xs, 99) * unit:8.1f} ms" if xs else f"  {name:<5} n/a")
    print(f"rate {rate} req/s, temperature {temperature}: {len(ok)} ok, {len(errors)} errors {sorted(set(errors)) or ''}, wall {wall:.1f} s")
    print(f"  throughput {len(ok) / wall:.2f} req/s, output {sum(r['out'] for r in ok) / wall:.1f} tok/s, "
          f"total {sum(r['out'] + r['in'] for r in ok) / wall:.1f} tok/s")
    if client_cpu is not None:
        print(f"  client: {client_cpu:.1f} CPU s in {procs} process(es), {client_cpu / wall / procs:.2f} of each one's wall"
              " (near 1: the client sets the pace)")
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
    ap.add_argument("--prefix-len", type=int, default=0,
                    help="every prompt begins with the same this many random tokens (a system prompt; vLLM's "
                         "--random-prefix-len), before its own")
    ap.add_argument("--max-token-id", type=int, default=40000,
                    help="prompts are random token ids in [100, this) (a tiny test model: its vocabulary's size)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="every request's temperature (0: greedy; the API's default is 1.0)")
    ap.add_argument("--client-procs", type=int, default=default_client_procs(),
                    help="client processes sending the load (default: the cores left after the server, two each, "
                         "at most 8)")
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
            low = min(100, args.max_token_id - 1)
            prefix = [rng.randrange(low, args.max_token_id) for _ in range(args.prefix_len)]
            reqs = [(prefix + [rng.randrange(low, args.max_token_id) for _ in range(rng.randint(args.min_prompt, args.max_prompt))],
                     rng.randint(args.min_output, args.max_output)) for _ in range(args.num_requests)]
            results, wall, cpu = run_load(url, model, rate, reqs, args.seed + k, args.temperature, args.client_procs)
            summarize(rate, results, wall, args.temperature, cpu, args.client_procs)
    finally:
        for v in views:
            print(f"  live view: {v.stop()} events received")
        if proc is not None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
