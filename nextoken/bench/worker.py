"""One figure of `nextoken bench` (``nextoken/bench/harness.py``), measured in a process of its own.

    python -m nextoken.bench.worker --worker nextoken|llama.cpp --mode single|batched \
        --model-path FILE [workload flags] [nextoken's engine flags]

Prints one JSON line. nextoken's engine is built from the same `EngineArgs` flags as every
other command (the driver passes them on); llama.cpp (through ``llama-cpp-python``, possibly in
a Python without torch) reads the thread count and the context from them. Not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import time

from nextoken.engine_args import EngineArgs  # imports no torch: the llama.cpp side may have none


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def read_bandwidth(threads: int | None = None, nbytes: int = 1 << 29, repeats: int = 20,
                   huge_pages: bool = True) -> float:
    """Bytes/s this machine reads from memory with `threads` threads (default: PyTorch's current
    number): the best of `repeats` float32 sums over `nbytes` (512 MiB, far past any cache), in
    2 MiB pages where the kernel gives them and `huge_pages` asks (as the weights:
    `runner.huge_pages`; on 4 KiB pages the same read was 20-25% slower on a VM). The best, so
    the cap is an upper bound: a shared machine's bandwidth varies by 30% from one second to the
    next. `nextoken bench` measures it in its single-stream process, after the figures."""
    import mmap

    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    x = torch.frombuffer(buf, dtype=torch.float32)
    x.fill_(1.0)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    del x
    buf.close()
    return nbytes / best


def _prompt(n: int, vocab: int, seed: int, skip: set[int] = frozenset()) -> list[int]:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        t = rng.randrange(100, vocab)
        if t not in skip:
            out.append(t)
    return out


def nextoken_worker(a, engine_args: EngineArgs) -> dict:
    import torch

    from nextoken.llm import LLM
    from nextoken.sampling_params import SamplingParams

    batched = a.mode == "batched"
    llm = LLM.from_engine_args(engine_args.replace(model=a.model_path, max_num_seqs=a.batch if batched else 1))
    skip = set(llm.tokenizer.special_ids) if hasattr(llm.tokenizer, "special_ids") else set()
    vocab = llm.config.vocab_size

    def greedy(n, logprobs=None):
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=logprobs)

    def sampled(n):  # the sampled row's settings (`nextoken bench --temperature/--top-p/--top-k`)
        return SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=n, ignore_eos=True,
                              seed=0)

    warm = llm.generate([_prompt(a.prompt_tokens, vocab, 99, skip)], greedy(4, logprobs=1))  # warm-up (and compiles)
    _check_finite(warm[0])
    if batched:
        prompts = [_prompt(a.batch_prompt_tokens, vocab, i, skip) for i in range(a.batch)]
        total = a.batch * (a.batch_prompt_tokens + a.batch_output_tokens)
        out = {"threads": torch.get_num_threads()}
        for key, params in (("batched", greedy(a.batch_output_tokens)), ("batched_sampled", sampled(a.batch_output_tokens))):
            with SamplerClock(llm) as clock:
                t = time.perf_counter()
                outs = llm.generate(prompts, params)
                dt = time.perf_counter() - t
            assert all(len(o.outputs[0].token_ids) == a.batch_output_tokens for o in outs)
            out.update({f"{key}_tok_s": total / dt, f"{key}_output_tok_s": a.batch * a.batch_output_tokens / dt,
                        f"{key}_sampler_ms": clock.ms_per_step()})
        return out
    if a.depth:
        return _nextoken_at_depth(a, llm, greedy, vocab, skip)
    prompt = _prompt(a.prompt_tokens, vocab, 0, skip)
    ttfts = [llm.generate([prompt], greedy(1))[0].metrics.ttft for _ in range(a.repeat)]
    res = {"prefill_tok_s": a.prompt_tokens / statistics.median(ttfts)}
    # greedy and sampled alternated `repeat` times, the best of each: this VM's speed drifts within
    # a minute, and one run after the other would put the drift into the ratio
    for _ in range(a.repeat):
        for key, params in (("decode", greedy(a.decode_tokens + 1)), ("decode_sampled", sampled(a.decode_tokens + 1))):
            with SamplerClock(llm) as clock:
                m = llm.generate([_prompt(8, vocab, 1, skip)], params)[0].metrics
            tok_s = a.decode_tokens / (m.finished_time - m.first_token_time)
            if tok_s > res.get(f"{key}_tok_s", 0.0):
                res[f"{key}_tok_s"] = tok_s
            res[f"{key}_sampler_ms"] = clock.ms_per_step()
    return {**res, "peak_rss_mib": _peak_rss_mib(), **_sizes(llm), **_bandwidth(a, llm)}


class SamplerClock:
    """Times the engine's draws while it is open (the engine's sampler is wrapped): its three
    entries, `Sampler.__call__`, `draw_checked` (a step of plain rows: the usual decode step) and
    `launch` (async scheduling); `ms_per_step` is their mean per draw (a `draw_checked` that
    declines the rows counts with the call that then draws them)."""

    def __init__(self, llm):
        self.engine, self.times = llm.engine, []

    def __enter__(self):
        sampler, times, carry = self.engine.sampler, self.times, [0.0]

        def timed(fn, may_decline: bool = False):
            def call(*args, **kwargs):
                t = time.perf_counter()
                out = fn(*args, **kwargs)
                carry[0] += time.perf_counter() - t
                if not (may_decline and out is None):  # (None: not drawn; the call draws next)
                    times.append(carry[0])
                    carry[0] = 0.0
                return out
            return call

        draw = timed(sampler)

        class Timed:
            draw_checked = staticmethod(timed(sampler.draw_checked, may_decline=True))
            launch = staticmethod(timed(sampler.launch))

            def __call__(self, *args, **kwargs):
                return draw(*args, **kwargs)

            def __getattr__(self, name):
                return getattr(sampler, name)

        self.engine.sampler = Timed()
        self.inner = sampler
        return self

    def __exit__(self, *exc):
        self.engine.sampler = self.inner

    def ms_per_step(self) -> float | None:
        """The mean in ms; None when no draw was timed."""
        return 1000 * sum(self.times) / len(self.times) if self.times else None


def _check_finite(out) -> None:
    """A timing of garbage is no timing: NaN arithmetic runs faster than real numbers (a NaN bug in
    the C prefill softmax once inflated Qwen2.5-1.5B's figures), so the warm-up's log-probabilities
    must be finite."""
    if out.error is not None or not out.outputs[0].logprobs_finite():
        raise RuntimeError(f"the model produced non-finite log-probabilities ({out.outputs[0].logprobs[:2]}): "
                           "its timings would be meaningless")


def _sizes(llm) -> dict:
    """Weights, KV cache, and the KV bytes each cached token adds (all layers, keys and values)."""
    import torch

    kv = llm.runner.kv
    return {"threads": torch.get_num_threads(), "weights_mib": llm.runner.weight_bytes / 2**20,
            "decode_weights_mib": llm.runner.decode_weight_bytes / 2**20,
            "kv_cache_mib": kv.nbytes / 2**20, "kv_bytes_per_token": kv.bytes_per_token}


def _bandwidth(a, llm) -> dict:
    """{"read_bandwidth": bytes/s} measured now, in the pages the weights got (2 MiB ones where the
    engine made its arena), or {} for a run told ``--no-bandwidth`` (a later round of the same
    bench: its first round's figure stands, and each measure faults in 512 MiB)."""
    if a.no_bandwidth:
        return {}
    return {"read_bandwidth": read_bandwidth(huge_pages=llm.engine.runner.weights_arena is not None)}


def _nextoken_at_depth(a, llm, greedy, vocab, skip) -> dict:
    """llama-bench's ``pp512 @ dN`` and ``tg128 @ dN``: a context of `a.depth` tokens is prefilled
    once (prefix caching keeps it); each prefill run then adds a fresh `a.prompt_tokens`-token
    suffix (timed to its first token), and the decode run generates after the cached context."""
    context = _prompt(a.depth, vocab, 2, skip)
    _check_finite(llm.generate([context], greedy(1, logprobs=1))[0])  # the context, cached (not timed)
    ttfts = [llm.generate([context + _prompt(a.prompt_tokens, vocab, 10 + i, skip)], greedy(1))[0].metrics.ttft
             for i in range(a.repeat)]
    m = llm.generate([context + _prompt(8, vocab, 1, skip)], greedy(a.decode_tokens + 1))[0].metrics
    return {"prefill_tok_s": a.prompt_tokens / statistics.median(ttfts),
            "decode_tok_s": a.decode_tokens / (m.finished_time - m.first_token_time), "peak_rss_mib": _peak_rss_mib(),
            **_sizes(llm), **_bandwidth(a, llm)}


def _llama_forward(llm, token_ids: list[int]) -> None:
    """One llama.cpp forward pass over `token_ids` (``Llama.eval`` wraps ``llama_decode``: it runs
    the model on token ids, nothing is evaluated as code); the last logits land in ``llm.scores``."""
    llm.eval(token_ids)


def llama_cpp_worker(a, engine_args: EngineArgs) -> dict:
    import numpy as np
    import llama_cpp as L

    threads, context = engine_args.num_threads, engine_args.max_model_len
    if a.mode == "batched":
        return _llama_cpp_batched(a, threads, L, np)
    llm = L.Llama(a.model_path, n_ctx=context, n_batch=a.prompt_tokens, n_threads=threads,
                  n_threads_batch=threads, verbose=False)
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
            "peak_rss_mib": _peak_rss_mib(), "threads": threads, "version": L.__version__}


def _llama_cpp_batched(a, threads: int, L, np) -> dict:
    """Like llama-batched-bench: every prompt in one batch, then one token per sequence per step."""
    L.llama_backend_init()
    model = L.llama_model_load_from_file(a.model_path.encode(), L.llama_model_default_params())
    n_seq, p, o = a.batch, a.batch_prompt_tokens, a.batch_output_tokens
    cp = L.llama_context_default_params()
    cp.n_ctx = n_seq * (p + o) + 16
    cp.n_batch = cp.n_ubatch = 512
    cp.n_seq_max = n_seq
    cp.n_threads = cp.n_threads_batch = threads
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
    return {"batched_tok_s": n_seq * (p + o) / dt, "batched_output_tok_s": n_seq * o / dt, "threads": threads}


def parse(argv: list[str]) -> tuple[argparse.Namespace, EngineArgs]:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", choices=("nextoken", "llama.cpp"), required=True)
    p.add_argument("--mode", choices=["single", "batched"], required=True)
    p.add_argument("--model-path", required=True)
    for name in ("prompt-tokens", "decode-tokens", "batch", "batch-prompt-tokens", "batch-output-tokens", "repeat",
                 "depth"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--no-bandwidth", action="store_true", help="skip the memory read bandwidth's measure")
    EngineArgs.add_cli_args(p, exclude=("model", "max_num_seqs"))
    a = p.parse_args(argv)
    return a, EngineArgs.from_cli_args(a, model=a.model_path)


def main(argv: list[str]) -> int:
    a, engine_args = parse(argv)
    res = nextoken_worker(a, engine_args) if a.worker == "nextoken" else llama_cpp_worker(a, engine_args)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
