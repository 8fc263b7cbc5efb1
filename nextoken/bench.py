"""`nextoken bench`: prefill, decode, batched throughput and peak memory, optionally beside llama.cpp.

    nextoken bench                                  # SmolLM2, nextoken only
    nextoken bench --compare llama.cpp --threads 2  # the same figures for llama.cpp, and ratios

Figures (the same workload for both engines, greedy, end-of-sequence ignored):

- prefill: tokens/s of one `--prompt-tokens` prompt (default 512; llama-bench's pp512);
- decode: single-stream tokens/s over `--decode-tokens` new tokens after an 8-token prompt (tg128);
- batched: `--batch` requests of `--batch-prompt-tokens` + `--batch-output-tokens` run together;
  total (prompt + output) tokens/s, as llama-batched-bench's ``S t/s``;
- peak resident memory (``ru_maxrss``) of the single-stream process, with a
  `--max-model-len`-token context (2048 default), the model loaded and both single-stream runs
  done.

Every figure comes from its own child process running ``benchmarks/bench_worker.py`` of the
source checkout (so memory and thread pools do not mix), after a warm-up run; prefill is the
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
WORKER = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_worker.py"


def _run_worker(python: str, engine: str, mode: str, a, engine_args) -> dict:
    # a script of its own: the llama.cpp side may have no torch (nextoken.engine_args imports none)
    cmd = [python, str(WORKER), "--worker", engine, "--mode", mode, "--model-path", a.model_path,
           "--prompt-tokens", str(a.prompt_tokens), "--decode-tokens", str(a.decode_tokens), "--batch", str(a.batch),
           "--batch-prompt-tokens", str(a.batch_prompt_tokens),
           "--batch-output-tokens", str(a.batch_output_tokens), "--repeat", str(a.repeat),
           *engine_args.to_cli_args(exclude=("model",) + BENCH_EXCLUDED)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_package_root(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        from nextoken.errors import EngineError

        raise EngineError(f"{engine} {mode} run failed: {' | '.join(tail)}")
    return json.loads(lines[-1])


def _package_root() -> str:
    return str(Path(__file__).resolve().parent.parent)


def find_llama_python(explicit: str | None) -> str | None:
    """A Python that can import llama_cpp: `explicit`, else this one, else None."""
    for python in ([explicit] if explicit else [sys.executable]):
        ok = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0
        if ok:
            return python
    return None


ROWS = [("prefill", "prefill_tok_s", "tok/s"), ("decode", "decode_tok_s", "tok/s"),
        ("batched", "batched_tok_s", "tok/s"), ("peak memory", "peak_rss_mib", "MiB")]


def format_table(results: dict[str, dict], a, threads: int, context: int) -> str:
    engines = list(results)
    head = (f"model {os.path.basename(a.model_path)}, {threads} threads | prefill: {a.prompt_tokens}-token prompt"
            f" | decode: {a.decode_tokens} tokens, one stream | batched: {a.batch} x ({a.batch_prompt_tokens} + "
            f"{a.batch_output_tokens}) tokens, total tok/s | peak memory: single-stream process, "
            f"{context}-token context")
    cols = ["", *engines] + (["nextoken / llama.cpp"] if len(engines) == 2 else [])
    lines = [head, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for label, key, unit in ROWS:
        vals = [results[e].get(key) for e in engines]
        cells = [f"{label} ({unit})"] + [f"{v:.1f}" if v is not None else "n/a" for v in vals]
        if len(engines) == 2:
            cells.append(f"{vals[0] / vals[1]:.2f}x" if None not in vals and vals[1] else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(a, engine_args) -> int:
    """Measure as `a` (the bench flags) says, nextoken's engine built from `engine_args`."""
    from nextoken.catalog import resolve_model
    from nextoken.errors import InvalidRequest

    if not WORKER.is_file():
        raise InvalidRequest(f"nextoken bench runs {WORKER.relative_to(WORKER.parent.parent)} of a source checkout, "
                             f"which is missing here ({WORKER})", "bench")
    a.model_path = str(resolve_model(engine_args.model, auto_pull=engine_args.auto_pull))
    threads = engine_args.num_threads or len(os.sched_getaffinity(0))
    engine_args = engine_args.replace(num_threads=threads)
    for name in ("prompt_tokens", "decode_tokens", "batch", "batch_prompt_tokens", "batch_output_tokens", "repeat"):
        if getattr(a, name) < 1:
            raise InvalidRequest(f"--{name.replace('_', '-')} must be >= 1", name)
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
            if mode == "batched" and a.no_batched:
                continue
            sys.stderr.write(f"[bench] {engine}: {mode} ...\n")
            results[engine].update(_run_worker(python, engine, mode, a, engine_args))
    context = engine_args.max_model_len
    print(format_table(results, a, threads, context))
    if a.json:
        with open(a.json, "w") as f:
            args = {k: v for k, v in vars(a).items() if k != "func"}
            json.dump({"args": args, "engine_args": vars(engine_args), "results": results}, f, indent=2)
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
    p.add_argument("--no-batched", action="store_true", help="skip the batched runs")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
