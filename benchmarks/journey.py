"""How long one step of the inspector's journey takes (``POST /inspect/api/journey/step``: the
engine's pass for the logits, the traced pass, and the stages' views), as the page calls it.

    python benchmarks/journey.py                         # SmolLM2, 20 greedy steps, then 20 sampled
    python benchmarks/journey.py --model qwen2.5-coder-0.5b-instruct

Starts `nextoken serve` itself; prints each step's wall time at the client (median, p90, max)
and the server's own `step_ms`.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path

import httpx

spec = importlib.util.spec_from_file_location("serve_bench", Path(__file__).resolve().parent / "serve.py")
serve_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serve_bench)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--port", type=int, default=8320)
    ap.add_argument("--prompt", default="The capital of France is")
    a = ap.parse_args()
    proc, url = serve_bench.launch(a.model, a.port, [])  # benchmarks/serve.py's: serve, wait for /health
    try:
        for name, settings in (("greedy", {"temperature": 0}), ("sampled", {"temperature": 1.0, "seed": 1})):
            generated, wall, server = [], [], []
            httpx.post(f"{url}/inspect/api/journey/step", json={"prompt": a.prompt, **settings}, timeout=60)  # warm-up
            for _ in range(a.steps):
                t = time.perf_counter()
                v = httpx.post(f"{url}/inspect/api/journey/step",
                               json={"prompt": a.prompt, "generated": generated, **settings}, timeout=60).json()
                wall.append((time.perf_counter() - t) * 1000)
                server.append(v["step_ms"])
                generated.append(v["choice"]["id"])
            wall.sort()
            print(f"{a.model} journey step, {name}, {a.steps} steps from a {v['prompt_tokens']}-token prompt: "
                  f"median {statistics.median(wall):.0f} ms, p90 {wall[int(0.9 * (len(wall) - 1))]:.0f} ms, "
                  f"max {wall[-1]:.0f} ms at the client (server {statistics.median(server):.0f} ms median)")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
