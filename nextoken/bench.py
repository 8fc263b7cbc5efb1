"""`nextoken bench`: prefill, decode, batched throughput and peak memory, optionally beside llama.cpp.

    nextoken bench                                  # SmolLM2, nextoken only
    nextoken bench --compare llama.cpp --threads 2  # the same figures for llama.cpp, and ratios

Figures (the same workload for both engines, greedy, end-of-sequence ignored):

- prefill: tokens/s of one `--prompt-tokens` prompt (default 512; llama-bench's pp512);
- decode: single-stream tokens/s over `--decode-tokens` new tokens after an 8-token prompt (tg128);
- batched: `--batch` requests of `--batch-prompt-tokens` + `--batch-output-tokens` run together;
  total (prompt + output) tokens/s, as llama-batched-bench's ``S t/s``;
- peak resident memory (``ru_maxrss``) of the single-stream process, with a `--context`-token
  context (2048 default), the model loaded and both single-stream runs done.

Every figure comes from its own child process (so memory and thread pools do not mix), after a
warm-up run; prefill is the median of `--repeat` runs. llama.cpp runs through
``llama-cpp-python`` (in `--llama-python`'s environment if it is not installed here), with the
same GGUF file and thread count. Prompts are random token ids (seed 0) outside the special
tokens, so no tokenizer or chat template takes part.
"""

from __future__ import annotations

import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time

ENGINES = ("nextoken", "llama.cpp")


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _prompt(n: int, vocab: int, seed: int, skip: set[int] = frozenset()) -> list[int]:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        t = rng.randrange(100, vocab)
        if t not in skip:
            out.append(t)
    return out


# -- workers: each runs in its own process and prints one JSON line ---------------------------
def nextoken_worker(a) -> dict:
    import torch

    from nextoken.kernels import set_enforce_eager
    from nextoken.llm import LLM
    from nextoken.sampling_params import SamplingParams

    if a.enforce_eager:
        set_enforce_eager(True)
    batched = a.mode == "batched"
    llm = LLM(a.model_path, num_threads=a.threads, max_num_seqs=a.batch if batched else 1,
              max_model_len=a.context, enable_prefix_caching=False)
    skip = set(llm.tokenizer.special_ids) if hasattr(llm.tokenizer, "special_ids") else set()
    vocab = llm.config.vocab_size

    def greedy(n):
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    llm.generate([_prompt(a.prompt_tokens, vocab, 99, skip)], greedy(4))  # warm-up (and compiles)
    if batched:
        prompts = [_prompt(a.batch_prompt_tokens, vocab, i, skip) for i in range(a.batch)]
        t = time.perf_counter()
        outs = llm.generate(prompts, greedy(a.batch_output_tokens))
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == a.batch_output_tokens for o in outs)
        total = a.batch * (a.batch_prompt_tokens + a.batch_output_tokens)
        return {"batched_tok_s": total / dt, "batched_output_tok_s": a.batch * a.batch_output_tokens / dt,
                "threads": torch.get_num_threads()}
    prompt = _prompt(a.prompt_tokens, vocab, 0, skip)
    ttfts = [llm.generate([prompt], greedy(1))[0].metrics.ttft for _ in range(a.repeat)]
    out = llm.generate([_prompt(8, vocab, 1, skip)], greedy(a.decode_tokens + 1))[0]
    m = out.metrics
    decode = a.decode_tokens / (m.finished_time - m.first_token_time)
    return {"prefill_tok_s": a.prompt_tokens / statistics.median(ttfts), "decode_tok_s": decode,
            "peak_rss_mib": _peak_rss_mib(), "threads": torch.get_num_threads(),
            "weights_mib": llm.runner.weight_bytes / 2**20, "kv_cache_mib": llm.runner.kv.nbytes / 2**20}


def _llama_forward(llm, token_ids: list[int]) -> None:
    """One llama.cpp forward pass over `token_ids` (``Llama.eval`` wraps ``llama_decode``: it runs
    the model on token ids, nothing is evaluated as code); the last logits land in ``llm.scores``."""
    llm.eval(token_ids)


def llama_cpp_worker(a) -> dict:
    import numpy as np
    import llama_cpp as L

    if a.mode == "batched":
        return _llama_cpp_batched(a, L, np)
    llm = L.Llama(a.model_path, n_ctx=a.context, n_batch=a.prompt_tokens, n_threads=a.threads,
                  n_threads_batch=a.threads, verbose=False)
    vocab = llm.n_vocab()
    warm = _prompt(a.prompt_tokens, vocab, 99)
    llm.reset()
    _llama_forward(llm, warm)
    prompt = _prompt(a.prompt_tokens, vocab, 0)
    times = []
    for _ in range(a.repeat):
        llm.reset()
        t = time.perf_counter()
        _llama_forward(llm, prompt)
        int(np.argmax(llm.scores[llm.n_tokens - 1]))
        times.append(time.perf_counter() - t)
    llm.reset()
    _llama_forward(llm, _prompt(8, vocab, 1))
    t = time.perf_counter()
    for _ in range(a.decode_tokens):
        _llama_forward(llm, [int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    decode = a.decode_tokens / (time.perf_counter() - t)
    return {"prefill_tok_s": a.prompt_tokens / statistics.median(times), "decode_tok_s": decode,
            "peak_rss_mib": _peak_rss_mib(), "threads": a.threads, "version": L.__version__}


def _llama_cpp_batched(a, L, np) -> dict:
    """Like llama-batched-bench: every prompt in one batch, then one token per sequence per step."""
    L.llama_backend_init()
    model = L.llama_model_load_from_file(a.model_path.encode(), L.llama_model_default_params())
    n_seq, p, o = a.batch, a.batch_prompt_tokens, a.batch_output_tokens
    cp = L.llama_context_default_params()
    cp.n_ctx = n_seq * (p + o) + 16
    cp.n_batch = cp.n_ubatch = 512
    cp.n_seq_max = n_seq
    cp.n_threads = cp.n_threads_batch = a.threads
    cp.kv_unified = True
    ctx = L.llama_init_from_model(model, cp)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(512, 0, 1)

    def decode(items):  # items: (token, pos, seq, wants_logits); returns {seq: batch row of its logits}
        rows = {}
        for start in range(0, len(items), 512):
            chunk = items[start : start + 512]
            batch.n_tokens = len(chunk)
            for i, (tok, pos, seq, want) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, int(want)
                if want:
                    rows[seq] = i
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
        return rows

    def next_tokens(rows):
        return {s: int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(vocab,))))
                for s, i in rows.items()}

    prompts = [_prompt(p, vocab, i) for i in range(n_seq)]
    t = time.perf_counter()
    # prompts in 512-token chunks; a sequence's logits are read right after the chunk holding its end
    items = [(tok, j, s, j == p - 1) for s, pr in enumerate(prompts) for j, tok in enumerate(pr)]
    toks = {}
    for start in range(0, len(items), 512):
        toks.update(next_tokens(decode(items[start : start + 512])))
    for step in range(o - 1):
        toks = next_tokens(decode([(toks[s], p + step, s, True) for s in range(n_seq)]))
    dt = time.perf_counter() - t
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    return {"batched_tok_s": n_seq * (p + o) / dt, "batched_output_tok_s": n_seq * o / dt, "threads": a.threads}


# -- the driver -----------------------------------------------------------------------------
def _run_worker(python: str, engine: str, mode: str, a) -> dict:
    # run as a script, not `-m nextoken.bench`: the llama.cpp side may have no torch to import nextoken
    cmd = [python, os.path.abspath(__file__), "--worker", engine, "--mode", mode, "--model-path", a.model_path,
           "--threads", str(a.threads), "--context", str(a.context), "--prompt-tokens", str(a.prompt_tokens),
           "--decode-tokens", str(a.decode_tokens), "--batch", str(a.batch),
           "--batch-prompt-tokens", str(a.batch_prompt_tokens),
           "--batch-output-tokens", str(a.batch_output_tokens), "--repeat", str(a.repeat)]
    if a.enforce_eager:
        cmd.append("--enforce-eager")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_package_root(), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        from nextoken.errors import EngineError

        raise EngineError(f"{engine} {mode} run failed: {' | '.join(tail)}")
    return json.loads(lines[-1])


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def find_llama_python(explicit: str | None) -> str | None:
    """A Python that can import llama_cpp: `explicit`, else this one, else None."""
    for python in ([explicit] if explicit else [sys.executable]):
        ok = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0
        if ok:
            return python
    return None


ROWS = [("prefill", "prefill_tok_s", "tok/s"), ("decode", "decode_tok_s", "tok/s"),
        ("batched", "batched_tok_s", "tok/s"), ("peak memory", "peak_rss_mib", "MiB")]


def format_table(results: dict[str, dict], a) -> str:
    engines = list(results)
    head = (f"model {os.path.basename(a.model_path)}, {a.threads} threads | prefill: {a.prompt_tokens}-token prompt"
            f" | decode: {a.decode_tokens} tokens, one stream | batched: {a.batch} x ({a.batch_prompt_tokens} + "
            f"{a.batch_output_tokens}) tokens, total tok/s | peak memory: single-stream process, "
            f"{a.context}-token context")
    cols = ["", *engines] + (["nextoken / llama.cpp"] if len(engines) == 2 else [])
    lines = [head, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for label, key, unit in ROWS:
        vals = [results[e].get(key) for e in engines]
        cells = [f"{label} ({unit})"] + [f"{v:.1f}" if v is not None else "n/a" for v in vals]
        if len(engines) == 2:
            cells.append(f"{vals[0] / vals[1]:.2f}x" if None not in vals and vals[1] else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(a) -> int:
    from nextoken.catalog import resolve_model
    from nextoken.errors import InvalidRequest

    a.model_path = str(resolve_model(a.model, auto_pull=True))
    a.threads = a.threads or len(os.sched_getaffinity(0))
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
            results[engine].update(_run_worker(python, engine, mode, a))
    print(format_table(results, a))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(a).items() if k != "func"}, "results": results}, f, indent=2)
    return 0


def add_arguments(p) -> None:
    p.add_argument("--model", "-m", default=None, help="catalog name or .gguf path (default: the default model)")
    p.add_argument("--compare", choices=["llama.cpp"], default=None, help="measure llama.cpp in the same run")
    p.add_argument("--llama-python", default=None, help="a Python with llama-cpp-python (default: this one)")
    p.add_argument("--threads", type=int, default=None, help="threads for both engines (default: the cores)")
    p.add_argument("--context", type=int, default=2048, help="context (KV cache) of the single-stream runs")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batch-prompt-tokens", type=int, default=128)
    p.add_argument("--batch-output-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3, help="prefill runs (the median counts)")
    p.add_argument("--no-batched", action="store_true", help="skip the batched runs")
    p.add_argument("--enforce-eager", action="store_true", help="nextoken without its native kernels")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")


def _worker_main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--worker", choices=ENGINES, required=True)
    p.add_argument("--mode", choices=["single", "batched"], required=True)
    p.add_argument("--model-path", required=True)
    for name in ("threads", "context", "prompt-tokens", "decode-tokens", "batch", "batch-prompt-tokens",
                 "batch-output-tokens", "repeat"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--enforce-eager", action="store_true")
    a = p.parse_args(argv)
    if a.worker == "nextoken":
        res = nextoken_worker(a)
    else:
        res = llama_cpp_worker(a)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
