"""`nextoken bench`: prefill, decode, batched throughput and peak memory, optionally beside llama.cpp.

    nextoken bench                                  # SmolLM2, nextoken only
    nextoken bench --compare llama.cpp --threads 2  # the same figures for llama.cpp, and ratios

Figures (the same workload for both engines, greedy, end-of-sequence ignored; nextoken's decode and
batched figures also sampled, with `--temperature` (default 1.0), `--top-p`, `--top-k`, beside
the greedy ones, and the time its sampler takes per step in both):

- prefill: tokens/s of one `--prompt-tokens` prompt (default 512; llama-bench's pp512);
- decode: single-stream tokens/s over `--decode-tokens` new tokens after an 8-token prompt (tg128;
  llama.cpp's figures are its forward passes with an argmax, no sampler); nextoken's greedy and
  sampled runs alternate `--repeat` times and the best of each counts;
- batched: `--batch` requests of `--batch-prompt-tokens` + `--batch-output-tokens` run together;
  total (prompt + output) tokens/s, as llama-batched-bench's ``S t/s``;
- peak resident memory (``ru_maxrss``) of the single-stream process, with a
  `--max-model-len`-token context (2048 default), the model loaded and both single-stream runs
  done;
- with ``--depth N``: prefill and decode after N cached tokens (llama-bench's ``pp512 @ dN``,
  ``tg128 @ dN``);
- with ``--cold-start``: seconds from starting a fresh process to its first token
  (``nextoken run`` on a `COLD_PROMPT_TOKENS`-token prompt; llama.cpp: ``llama-bench`` loading
  the model and running one pass over as many tokens) and until ``nextoken serve`` answers
  ``/health``; the median of `--repeat` starts after one untimed start (which fills the page
  cache and any cache of ours, as a second start of a server would find them);
- the decode figures as a share of the bandwidth cap: the measured read bandwidth of this machine
  (`worker.read_bandwidth`, in the single-stream process after its runs) over the bytes one decode
  step reads (the weights it reads, `ModelRunner.decode_weight_bytes`: one row of an untied
  embedding table, a tied one once as the LM head; plus the KV cache at that depth). Shares
  printed before 2026-11-26 counted the whole embedding table too (`docs/benchmarks.md`).

``--llama-bench PATH`` runs llama.cpp's own ``llama-bench`` binary in the same run (the Python
binding adds overhead: it reads about 15% lower here), alternating: `--rounds` times (default 3)
nextoken's single-stream figures, then llama-bench's, so a machine whose speed drifts by 10-30%
within minutes drifts for both. Each round's pair and ratio are printed, and the table holds the
medians, with the median of the rounds' ratios; the header names the CPU, its SIMD flags and the
loop our quantized matmul runs. ``--compare llama.cpp`` runs ``llama-cpp-python`` instead.

Every figure comes from its own child process running `nextoken.bench.worker` (shipped in the
package: an installed nextoken benches without a checkout; so memory and thread pools do not mix), after a warm-up run; prefill is the
median of `--repeat` runs. nextoken's engine takes every engine flag given here (`EngineArgs`),
except ``--max-num-seqs``, which the workload sets (1 for the single-stream figures, `--batch`
for the batched one). llama.cpp runs through ``llama-cpp-python`` (in `--llama-python`'s
environment if it is not installed here), with the same GGUF file, thread count and context.
Prompts are random token ids (seed 0) outside the special tokens, so no tokenizer or chat
template takes part.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ENGINES = ("nextoken", "llama.cpp")
BENCH_EXCLUDED = ("max_num_seqs",)  # set by the workload
BENCH_ENGINE_DEFAULTS = {"max_model_len": 2048, "enable_prefix_caching": False}
WORKER = "nextoken.bench.worker"  # run as `python -m`, with this package on the path


def _run_worker(python: str, engine: str, mode: str, a, engine_args, bandwidth: bool = True) -> dict:
    # a script of its own: the llama.cpp side may have no torch (nextoken.engine_args imports none)
    cmd = [python, "-m", WORKER, "--worker", engine, "--mode", mode, "--model-path", a.model_path,
           "--prompt-tokens", str(a.prompt_tokens), "--decode-tokens", str(a.decode_tokens), "--batch", str(a.batch),
           "--batch-prompt-tokens", str(a.batch_prompt_tokens),
           "--batch-output-tokens", str(a.batch_output_tokens), "--repeat", str(a.repeat), "--depth", str(a.depth),
           "--temperature", str(a.temperature), "--top-p", str(a.top_p), "--top-k", str(a.top_k),
           *engine_args.to_cli_args(exclude=("model",) + BENCH_EXCLUDED), *([] if bandwidth else ["--no-bandwidth"])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_package_root(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        from nextoken.errors import EngineError

        raise EngineError(f"{engine} {mode} run failed: {' | '.join(tail)}")
    return json.loads(lines[-1])


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[2])


def find_llama_python(explicit: str | None) -> str | None:
    """A Python that can import llama_cpp: `explicit`, else this one, else None."""
    for python in ([explicit] if explicit else [sys.executable]):
        ok = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0
        if ok:
            return python
    return None


ROWS = [("prefill", "prefill_tok_s", "tok/s"), ("decode, greedy", "decode_tok_s", "tok/s"),
        ("decode, sampled", "decode_sampled_tok_s", "tok/s"),
        ("decode / bandwidth cap (greedy)", "decode_cap_share", "%"),
        ("sampler per decode step, greedy / sampled", "decode_sampler_ms", "ms"),
        ("batched, greedy", "batched_tok_s", "tok/s"), ("batched, sampled", "batched_sampled_tok_s", "tok/s"),
        ("sampler per batched step, greedy / sampled", "batched_sampler_ms", "ms"),
        ("peak memory", "peak_rss_mib", "MiB"), ("cold start to first token", "cold_first_token_s", "s"),
        ("cold start to serve healthy", "cold_serve_healthy_s", "s")]
COLD_PROMPT_TOKENS = 128
COLD_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 13)  # about 128 tokens


def run_llama_bench(path: str, a, threads: int, kv_cache_dtype: str = "auto") -> dict:
    """llama.cpp's own ``llama-bench`` on the same workload (pp `prompt_tokens`, tg
    `decode_tokens`, at `depth`; with ``--kv-cache-dtype int8`` its q8_0 KV cache, ``-ctk q8_0
    -ctv q8_0``), and with `a.cold_start` its load-and-first-pass time."""
    from nextoken.errors import EngineError

    def bench(*args: str) -> list[dict]:
        cmd = [path, "-m", a.model_path, "-t", str(threads), "-o", "json", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise EngineError(f"llama-bench failed: {' | '.join((proc.stderr or proc.stdout).strip().splitlines()[-3:])}")
        return json.loads(proc.stdout)

    kv = ["-ctk", "q8_0", "-ctv", "q8_0"] if kv_cache_dtype == "int8" else []
    rows = bench("-p", str(a.prompt_tokens), "-n", str(a.decode_tokens), "-d", str(a.depth), "-r", str(a.repeat), *kv)
    out = {"prefill_tok_s": next(r["avg_ts"] for r in rows if r["n_gen"] == 0),
           "decode_tok_s": next(r["avg_ts"] for r in rows if r["n_gen"] > 0),
           "version": rows[0].get("build_commit")}
    if a.cold_start:
        cold = ["-p", str(COLD_PROMPT_TOKENS), "-n", "0", "-r", "1", "--no-warmup"]
        out["cold_first_token_s"] = _median_wall(lambda: bench(*cold), a.repeat)
    return out


def _median_wall(start, repeat: int) -> float:
    """Median wall seconds of `start()` over `repeat` calls, after one untimed call."""
    import statistics
    import time

    start()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        start()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def nextoken_cold_start(a, threads: int) -> dict:
    """Seconds from a fresh ``nextoken run`` process to its first token (the process ends after
    printing it), and from a fresh ``nextoken serve`` to a 200 from ``/health``."""
    import socket
    import time
    import urllib.request

    from nextoken.errors import EngineError

    base = [sys.executable, "-m", "nextoken"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_package_root(), os.environ.get("PYTHONPATH", "")]))

    def run_once():
        proc = subprocess.run([*base, "run", COLD_PROMPT, "--raw", "--model", a.model_path, "--max-tokens", "1",
                               "--threads", str(threads)], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise EngineError(f"nextoken run failed: {proc.stderr.strip().splitlines()[-1:]}")

    def serve_once():
        with socket.socket() as s_:
            s_.bind(("127.0.0.1", 0))
            port = s_.getsockname()[1]
        proc = subprocess.Popen([*base, "serve", "--model", a.model_path, "--port", str(port), "--threads", str(threads)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        try:
            while proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                        if r.status == 200:
                            return
                except OSError:
                    time.sleep(0.02)
            raise EngineError("nextoken serve exited before it was healthy")
        finally:
            proc.terminate()
            proc.wait()

    return {"cold_first_token_s": _median_wall(run_once, a.repeat),
            "cold_serve_healthy_s": _median_wall(serve_once, a.repeat)}


SIMD_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8")


def cpu_line() -> str:
    """The CPU's model name, its SIMD flags that pick our loops, and the loop the quantized
    matmul runs here (``NEXTOKEN_KERNEL_ISA`` may name an older one), for the bench's header."""
    from nextoken.kernels import default_isa, load

    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown CPU":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    lib = load("qmatmul")
    loop = lib.qmatmul_loop().decode() if lib is not None else "PyTorch"
    have = " ".join(f for f in SIMD_FLAGS if f in flags) or "none of " + " ".join(SIMD_FLAGS)
    return f"CPU: {model} | SIMD: {have} | our quantized matmul: {loop} loop (build {default_isa()})"


def alternate(a, engine_args, threads: int, first: dict) -> tuple[dict, dict, list[tuple[dict, dict]]]:
    """`a.rounds` rounds of nextoken's single-stream figures (`first` is round one's) then
    llama-bench's, alternated. Returns the median of each figure for both sides and the rounds.
    Raises `EngineError` when llama-bench fails."""
    import statistics

    pairs = []
    for r in range(a.rounds):
        ours = first if r == 0 else _run_worker(sys.executable, "nextoken", "single", a, engine_args, bandwidth=False)
        sys.stderr.write(f"[bench] llama-bench, round {r + 1} of {a.rounds} ...\n")
        theirs = run_llama_bench(a.llama_bench, a, threads, engine_args.kv_cache_dtype)
        pairs.append((ours, theirs))
        if r + 1 < a.rounds:
            sys.stderr.write(f"[bench] nextoken: single, round {r + 2} of {a.rounds} ...\n")
    med = lambda side, key: statistics.median(p[side][key] for p in pairs)  # noqa: E731
    ours = {k: med(0, k) for k in ("prefill_tok_s", "decode_tok_s", "decode_sampled_tok_s") if k in pairs[0][0]}
    theirs = {k: med(1, k) for k in ("prefill_tok_s", "decode_tok_s")}
    theirs.update({k: v for k, v in pairs[0][1].items() if k not in theirs})  # version, cold start (round one)
    return ours, theirs, pairs


def format_rounds(pairs: list[tuple[dict, dict]]) -> str:
    """Each round's prefill and greedy decode, ours and llama-bench's, and the median ratios."""
    import statistics

    lines = ["| round | prefill nextoken | prefill llama-bench | ratio | decode nextoken (greedy) | decode llama-bench "
             "| ratio |", "|---|---|---|---|---|---|---|"]
    rp, rd = [], []
    for i, (o, t) in enumerate(pairs, 1):
        rp.append(o["prefill_tok_s"] / t["prefill_tok_s"])
        rd.append(o["decode_tok_s"] / t["decode_tok_s"])
        lines.append(f"| {i} | {o['prefill_tok_s']:.1f} | {t['prefill_tok_s']:.1f} | {rp[-1]:.2f}x "
                     f"| {o['decode_tok_s']:.1f} | {t['decode_tok_s']:.1f} | {rd[-1]:.2f}x |")
    lines.append(f"| median | | | {statistics.median(rp):.2f}x | | | {statistics.median(rd):.2f}x |")
    return "\n".join(lines)


def add_cap_share(res: dict, bandwidth: float, a, weights: float, kv_per_token: float) -> None:
    """Decode tok/s as a share of the bandwidth cap: bandwidth / (weight bytes + the KV bytes
    of the average context of the decode run)."""
    if res.get("decode_tok_s") and weights:
        context = a.depth + 8 + a.decode_tokens / 2
        res["decode_cap_share"] = 100 * res["decode_tok_s"] * (weights + kv_per_token * context) / bandwidth


def format_table(results: dict[str, dict], a, threads: int, context: int) -> str:
    engines = list(results)
    depth = f" after {a.depth} cached tokens" if a.depth else ""
    sampled = f"temperature {a.temperature}" + (f", top-p {a.top_p}" if a.top_p < 1 else "") + \
        (f", top-k {a.top_k}" if a.top_k > 0 else "")
    head = (f"model {os.path.basename(a.model_path)}, {threads} threads | sampled rows: {sampled}; greedy rows and "
            f"llama.cpp's: argmax | prefill: {a.prompt_tokens}-token prompt{depth}"
            f" | decode: {a.decode_tokens} tokens, one stream{depth} | batched: {a.batch} x ({a.batch_prompt_tokens} + "
            f"{a.batch_output_tokens}) tokens, total tok/s | peak memory: single-stream process, "
            f"{context}-token context")
    peer = engines[-1] if len(engines) > 1 else None  # the ratio column: nextoken over the last peer
    cols = ["", *engines] + ([f"nextoken / {peer}"] if peer else [])
    lines = [head, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for label, key, unit in ROWS:
        vals = [results[e].get(key) for e in engines]
        sampler = key.endswith("_sampler_ms") and key in results[engines[0]]  # (None: no draw was timed)
        if all(v is None for v in vals) and not sampler:
            continue
        fmt = "{:.2f}" if unit in ("s", "ms") else "{:.1f}"
        cells = [f"{label} ({unit})"] + [fmt.format(v) if v is not None else "n/a" for v in vals]
        if sampler:  # greedy / sampled in one cell, nextoken's alone
            s = results[engines[0]].get(key.replace("_sampler_ms", "_sampled_sampler_ms"))
            ours = " / ".join("not timed" if v is None else f"{v:.2f}" for v in (vals[0], s))
            cells = [f"{label} ({unit})", ours] + ["n/a"] * (len(engines) - 1)
            if peer:
                cells.append("")
            lines.append("| " + " | ".join(cells) + " |")
            continue
        if peer:
            ours, theirs = vals[0], vals[-1]
            cells.append(f"{ours / theirs:.2f}x" if ours is not None and theirs else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(a, engine_args) -> int:
    """Measure as `a` (the bench flags) says, nextoken's engine built from `engine_args`."""
    from nextoken.catalog import resolve_model
    from nextoken.errors import EngineError, InvalidRequest

    a.model_path = str(resolve_model(engine_args.model, auto_pull=engine_args.auto_pull))
    from nextoken.runner.threads import default_threads

    threads = engine_args.num_threads or default_threads()
    engine_args = engine_args.replace(num_threads=threads)
    for name in ("prompt_tokens", "decode_tokens", "batch", "batch_prompt_tokens", "batch_output_tokens", "repeat",
                 "rounds"):
        if getattr(a, name) < 1:
            raise InvalidRequest(f"--{name.replace('_', '-')} must be >= 1", name)
    if a.depth < 0:
        raise InvalidRequest("--depth must be >= 0", "depth")
    if not 0 < a.temperature <= 100 or not 0 < a.top_p <= 1:
        raise InvalidRequest("--temperature must be in (0, 100] and --top-p in (0, 1] (the sampled rows)", "temperature")
    if a.depth:  # the context must fit, and stay cached between runs
        need = a.depth + a.prompt_tokens + a.decode_tokens + 16
        engine_args = engine_args.replace(max_model_len=max(engine_args.max_model_len, need), enable_prefix_caching=True)
    if a.llama_bench and not os.access(a.llama_bench, os.X_OK):
        raise InvalidRequest(f"--llama-bench {a.llama_bench}: not an executable file", "llama_bench")
    engines = {"nextoken": sys.executable}
    if a.compare:
        python = find_llama_python(a.llama_python)
        if python is None:
            raise InvalidRequest("--compare llama.cpp needs llama-cpp-python (pip install llama-cpp-python, or "
                                 "point --llama-python at a Python that has it)", "compare")
        engines["llama.cpp"] = python
    results = {}
    for engine, python in engines.items():
        results[engine] = {}
        for mode in ("single", "batched"):
            if mode == "batched" and (a.no_batched or a.depth):
                continue
            sys.stderr.write(f"[bench] {engine}: {mode} ...\n")
            results[engine].update(_run_worker(python, engine, mode, a, engine_args))
    if a.cold_start:
        sys.stderr.write("[bench] nextoken: cold start ...\n")
        results["nextoken"].update(nextoken_cold_start(a, threads))
    failed, pairs = None, []
    if a.llama_bench:
        try:
            ours, theirs, pairs = alternate(a, engine_args, threads, dict(results["nextoken"]))
            results["nextoken"].update(ours)
            results["llama-bench"] = theirs
        except EngineError as exc:  # minutes of our own figures are still worth printing
            failed = str(exc)
            sys.stderr.write(f"[bench] {failed}; its column is left out\n")
    ours = results["nextoken"]
    bandwidth = ours["read_bandwidth"]
    weights = ours.get("decode_weights_mib", 0) * 2**20
    for res in results.values():
        add_cap_share(res, bandwidth, a, weights, ours.get("kv_bytes_per_token", 0))
    sys.stderr.write(f"[bench] read bandwidth {bandwidth / 1e9:.1f} GB/s with {threads} threads\n")
    context = engine_args.max_model_len
    print(cpu_line())
    print(format_table(results, a, threads, context))
    if pairs:
        print("\nalternated rounds (nextoken's single-stream run, then llama-bench's; the table above: medians):")
        print(format_rounds(pairs))
    if a.json:
        with open(a.json, "w") as f:
            args = {k: v for k, v in vars(a).items() if k != "func"}
            json.dump({"args": args, "engine_args": vars(engine_args), "results": results, "cpu": cpu_line(),
                       "rounds": [{"nextoken": o, "llama-bench": t} for o, t in pairs]}, f, indent=2)
    if failed:
        sys.stderr.write(f"error: {failed}\n")
        return 1
    return 0


def add_arguments(p) -> None:
    """The workload's flags (the engine's come from `EngineArgs`; ``--threads`` serves both engines)."""
    import argparse

    p.add_argument("--compare", choices=["llama.cpp"], default=None, help="measure llama.cpp in the same run")
    p.add_argument("--llama-python", default=None, help="a Python with llama-cpp-python (default: this one)")
    p.add_argument("--context", dest="max_model_len", type=int, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # the old name of --max-model-len
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batch-prompt-tokens", type=int, default=128)
    p.add_argument("--batch-output-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3, help="prefill runs (the median counts)")
    p.add_argument("--temperature", type=float, default=1.0, help="the sampled rows' temperature (> 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="the sampled rows' top-p")
    p.add_argument("--top-k", type=int, default=-1, help="the sampled rows' top-k")
    p.add_argument("--no-batched", action="store_true", help="skip the batched runs")
    p.add_argument("--depth", type=int, default=0, help="prefill and decode after this many cached tokens "
                   "(llama-bench -d); the batched run is skipped")
    p.add_argument("--cold-start", action="store_true", help="also time fresh processes to their first token "
                   "and to a healthy server")
    p.add_argument("--llama-bench", default=None, metavar="PATH", help="llama.cpp's llama-bench binary, run on the "
                   "same workload in the same run, alternated with ours (--rounds)")
    p.add_argument("--rounds", type=int, default=3, help="with --llama-bench: alternated rounds of nextoken's "
                   "single-stream figures and llama-bench's (the medians count)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
