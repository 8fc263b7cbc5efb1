"""`nextoken run` against llama.cpp's `llama-server` on one prompt, as a user compares them: the
same GGUF, the same sampling (llama-server's defaults: temperature 0.8, top-k 40, top-p 0.95,
min-p 0.05, given to both), 128 tokens past the end of text, alternated pairs, decode tok/s.

    python benchmarks/run_vs_server.py --llama-server PATH [--model qwen2.5-coder-0.5b-instruct]
        [--pairs 5] [--threads 2] [--server-arg=--no-repack ...]

Each pair runs `nextoken run --stats` in a fresh process (its decode speed from the `[stats]`
line), then one `/completion` request to a llama-server started once beforehand and idle
between requests (its `timings.predicted_per_second`). Prints every pair and the median ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request

from nextoken.catalog import resolve_model

PROMPT = "Write a Python function that parses a CSV file and returns the rows as dictionaries."
SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


def ours(model: str, threads: int, tokens: int) -> float:
    """Decode tok/s of one `nextoken run` process."""
    cmd = [sys.executable, "-m", "nextoken", "run", "--model", model, "--threads", str(threads), "--max-tokens",
           str(tokens), "--ignore-eos", "--stats", "--temperature", str(SAMPLING["temperature"]),
           "--top-k", str(SAMPLING["top_k"]), "--top-p", str(SAMPLING["top_p"]), "--min-p", str(SAMPLING["min_p"]),
           PROMPT]
    err = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    found = re.search(r"decode ([0-9.]+) tok/s", err)
    if not found:
        raise RuntimeError(f"no decode figure in nextoken's output:\n{err[-2000:]}")
    return float(found.group(1))


def theirs(url: str, tokens: int) -> float:
    """Decode tok/s of one llama-server `/completion` request."""
    body = json.dumps({"prompt": PROMPT, "n_predict": tokens, "ignore_eos": True, "cache_prompt": False,
                       **SAMPLING}).encode()
    req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return float(json.load(resp)["timings"]["predicted_per_second"])


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("llama-server did not become healthy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="catalog name or GGUF path")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--port", type=int, default=8097)
    ap.add_argument("--server-arg", action="append", default=[], help="extra llama-server argument (repeatable)")
    args = ap.parse_args()
    gguf = str(resolve_model(args.model))
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([args.llama_server, "-m", gguf, "-t", str(args.threads), "--port", str(args.port),
                               "-c", "2048", "-np", "1", *args.server_arg],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, server)
        theirs(url, 8)  # warm-up
        ratios = []
        print(f"model {os.path.basename(gguf)}, {args.threads} threads, {args.tokens} tokens, sampling {SAMPLING}")
        print("| pair | nextoken run (tok/s) | llama-server (tok/s) | ratio |\n|---|---|---|---|")
        for i in range(args.pairs):
            a = ours(args.model, args.threads, args.tokens)
            b = theirs(url, args.tokens)
            ratios.append(a / b)
            print(f"| {i + 1} | {a:.1f} | {b:.1f} | {a / b:.2f}x |", flush=True)
        print(f"median ratio {statistics.median(ratios):.2f}x")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
