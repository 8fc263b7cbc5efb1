"""The GPU path's one prepared check (issue 61): its tests, exactness against `transformers`, the
speed goals against the card's measured limits, and a table printed last.

On the GPU machine, from the repository root, after the wheels it lacks are installed
(`benchmarks/gpu_wheels.sh` fetches them here into .whl/; the device call carries .whl):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_check.py            # about 8 minutes

As one device call (carry ``.whl``; its 6.6 MB and the repository's 3 MB travel):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && nvidia-smi -L &&
    timeout 585 python3 benchmarks/gpu_check.py --budget 490 2>&1 | tee $OUT/log.txt

Sections, in order, each timed and each allowed to fail alone (its error is printed and the
rest go on); a section that would start past the time budget (``--budget`` seconds) is skipped
and says so:

1. the card: name, memory, the HBM copy bandwidth (bytes read + written) and the bf16 matrix
   rate of an 8192^3 product (METHOD.md: measured, not the datasheet's);
2. per model (the catalog's four at their real sizes, random weights: `benchmarks/gpu_models.py`):
   exactness (float32, TF32 off: the logits of a prefill and 32 decode steps against
   `transformers` float32 on the same card, relative to the largest logit; bf16: the first 16
   greedy tokens equal `transformers`' bf16 greedy ones, every one of 32 in its top 5, and how far
   our bf16 log-probabilities and `transformers`' bf16 ones lie from `transformers`' float32; one
   request alone and in a batch of 24, float32 and bf16), then speed (batch-1 decode, greedy and
   sampled, against the bandwidth roofline; 64 sequences of 512 + 256 tokens, the decode step
   against the roofline step; the same batch-1 and 64-sequence runs again with async scheduling,
   and whether their tokens are the in-order run's; the sampled 64-sequence step again on
   PyTorch's draw, and the Triton draw's tokens and time against PyTorch's on 64 rows of the
   model's vocabulary, and with its scratch against recomputing each pass; one 4096-token
   prefill against the bf16 matrix rate);
3. serving (Qwen2.5-1.5B first): `nextoken serve` and `benchmarks/serve.py`'s client (in
   several processes, `serve.run_load`: one httpx process spends about 70 us a streamed chunk), 256
   requests of 100-1024 prompt and 100-1024 output tokens sent at once, output tokens/s, and from
   the server's /metrics the share of the wall its engine spent stepping and its mean step (a
   share well below 1: the HTTP layer or the client sets the pace, not the GPU; `--stream-interval
   N` serves with fewer, larger chunks, default 1 as users run it; ``--serve-async auto``, the
   default, serves with ``--async-scheduling`` when the speed section's async runs went through;
   ``--serve-process both``, the default, serves with ``--engine-process`` here, and in one process
   after every model's sections, as time allows, its figures as ``serve_oneproc_*``; with the
   engine process, ``--api-servers N`` HTTP server processes, 4 by default; the CPU each
   process spent over the wall says which side holds the pace, and py-spy's samples of each, when
   it came along, where its Python's time went; the Triton compilations its log shows after the
   warm-up; the workload's roofline on the card, `serving_roofline`); and `transformers`'
   `generate` on the same card at batch 128, 256 and 512 (its best kept);
4. after the first model's sections (the rows that matter most): the GPU tests, the Triton
   kernel's tests compiled, the engine's GPU-path tests on the GPU, every tiny architecture's
   float32 logits against `transformers` (pytest, TRITON_INTERPRET=0, on 8 xdist workers, each
   failure written to ``$OUT/test_failures.txt`` as it happens), after how far PyTorch's own bf16
   linear lies from float64 there; then the other models.

Every figure also goes to ``$OUT/gpu_check.json`` (and the server's log to ``$OUT``) when
``OUT`` is set. ``--dry-run`` runs the same sections on a machine without a GPU, on two tiny
models on the CPU (Triton's interpreter), to check the script itself before GPU time is spent.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

ORDER = ["qwen2.5-1.5b", "qwen2.5-0.5b", "smollm2-135m", "gemma-3-270m"]
RESULTS: dict = {"sections": {}, "models": {}}
START = time.perf_counter()
DEV = "cuda"  # "cpu" in a dry run
SPY_DIR = "/tmp/nextoken-gpu-check-spy"
DRY = {"others": 23, "speed_tokens": 256, "batch": 64, "prompt": 512, "prefill": 4096, "requests": 256,
       "hf_batches": (128, 256, 512), "b1_prompt": 128, "reps": 3}  # the workload's sizes (smaller in a dry run)


def on_device() -> dict:
    """`LLM` keywords of the GPU path: the GPU, or in a dry run the CPU with Triton attention; the
    steps in order (a GPU's default is async scheduling: the check turns it on where it measures it)."""
    if DEV == "cuda":
        return {"device": "cuda", "async_scheduling": False}
    return {"device": "cpu", "enforce_eager": True, "attention_backend": "triton", "async_scheduling": False}


def sync() -> None:
    import torch

    if DEV == "cuda":
        torch.cuda.synchronize()


def log(*args) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s]", *args, flush=True)


@contextlib.contextmanager
def section(name: str, budget: float, need: float = 0.0):
    """Run a section unless fewer than `need` seconds of the budget are left; record how it went."""
    left = budget - (time.perf_counter() - START)
    if left < need:
        log(f"== {name}: skipped, {left:.0f} s of the budget left (needs about {need:.0f})")
        RESULTS["sections"][name] = "skipped (time)"
        yield False
        return
    log(f"== {name}")
    t0 = time.perf_counter()
    try:
        yield True
        RESULTS["sections"][name] = f"ok ({time.perf_counter() - t0:.0f} s)"
    except Exception as exc:  # noqa: BLE001 - one section's failure is reported, the others still run
        traceback.print_exc()
        RESULTS["sections"][name] = f"FAILED: {type(exc).__name__}: {str(exc)[:300]}"
        log(f"   {name} failed: {type(exc).__name__}: {exc}")
    finally:
        free()


def free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def cuda_time(fn, repeat: int, warmup: int = 1) -> float:
    """Median seconds of `fn()` over `repeat` runs after `warmup`, timed with CUDA events (a
    host clock in a dry run)."""
    from nextoken.kernels.gpu.timing import median_seconds

    for _ in range(warmup):
        fn()
    if DEV == "cuda":
        return median_seconds(fn, repeat)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- 1. the card ----------------------------------------------------------------------------------
def card() -> dict:
    import torch
    import triton
    import transformers

    props = torch.cuda.get_device_properties(0)
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB, several times the L2
    x.random_()
    y = torch.empty_like(x)
    t = cuda_time(lambda: y.copy_(x), 10, 3)
    bandwidth = 2 * x.numel() / t
    x = y = None  # (2 GiB back before the matrices)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    t = cuda_time(lambda: a @ b, 10, 3)
    rate = 2 * 8192 ** 3 / t
    out = {"name": props.name, "sms": props.multi_processor_count, "memory_gib": props.total_memory / 2**30,
           "bandwidth": bandwidth, "bf16_rate": rate, "torch": torch.__version__, "cuda": torch.version.cuda,
           "triton": triton.__version__, "transformers": transformers.__version__}
    log(f"   {props.name}: {props.multi_processor_count} SMs, {props.total_memory / 2**30:.1f} GiB; copy "
        f"{bandwidth / 1e12:.2f} TB/s (read + written), bf16 8192^3 {rate / 1e12:.0f} TFLOP/s; torch "
        f"{torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}")
    return out


# -- 2. the tests ---------------------------------------------------------------------------------
def cublas_roundings() -> dict:
    """How far PyTorch's bf16 linear (cuBLAS) on this GPU is from the float64 product, in units of
    one bf16 rounding (the bound tests/kernels/test_gemv.py and test_skinny.py hold our kernels
    to, and PyTorch's only on the CPU): the worst element's |error| / bound, for the tests' cases
    (rows x 1100 by 150 x 1100, with and without a bias), with PyTorch's default reduced-precision
    reduction and without it."""
    import torch
    import torch.nn.functional as F

    back = torch.backends.cuda.matmul
    default, out = back.allow_bf16_reduced_precision_reduction, {}
    g = torch.Generator().manual_seed(1)
    for reduced in (default, False):
        back.allow_bf16_reduced_precision_reduction = reduced
        for m in (1, 5, 24, 64):
            for bias in (False, True):
                x = torch.randn(m, 1100, generator=g).to(torch.bfloat16).to(DEV)
                w = (torch.randn(150, 1100, generator=g) * 0.1).to(torch.bfloat16).to(DEV)
                b = torch.randn(150, generator=g).to(torch.bfloat16).to(DEV) if bias else None
                exact = x.double() @ w.double().T + (b.double() if bias else 0)
                step = exact.abs() * 2.0**-7 + 1e-6 * exact.abs().max()
                worst = float(((F.linear(x, w, b).double() - exact).abs() / step).max())
                name = f"{m} rows{' + bias' if bias else ''}{'' if reduced else ', full-precision reduction'}"
                out[name] = round(worst, 2)
    back.allow_bf16_reduced_precision_reduction = default
    return out


def gpu_tests(timeout: float) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))}
    if os.environ.get("OUT"):  # (each failure written as it happens: pytest_live.py)
        env["LIVE_FAILURES"] = os.path.join(os.environ["OUT"], "test_failures.txt")
    try:
        log("   PyTorch's bf16 linear against the float64 product, worst |error| in bf16 roundings:",
            cublas_roundings())
    except Exception as exc:  # (a diagnostic: the tests run regardless)
        log(f"   PyTorch's bf16 linear: {type(exc).__name__}: {exc}")
    workers = ["-n", "8"] if importlib.util.find_spec("xdist") else []  # (16 cores: the compilations in parallel)
    if importlib.util.find_spec("pytest_timeout"):
        workers += ["--timeout", "120"]  # (a test that hangs fails alone)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_live", *workers,
           "tests/kernels/test_triton_attention.py",
           "tests/kernels/test_batch_invariant.py", "tests/kernels/test_rowwise.py", "tests/kernels/test_gemv.py",
           "tests/kernels/test_skinny.py", "tests/kernels/test_gpu_sampling.py", "tests/engine/test_gpu_path.py",
           "tests/models/test_hf_models.py", "tests/models/test_embeddings.py",
           "-k", "triton or gpu or invariant or rowwise or gemv or skinny or draw or sampler",
           "-m", "slow or not slow"]  # (the interpreter's slow ones too)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        text, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:  # what ran so far, and the test it was in, stand
        text = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (exc.stdout, exc.stderr))
        text, code = text + f"\ntimed out after {timeout:.0f} s\n", -1
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "tests.log"), "w") as f:
            f.write(text)
    tail = text.strip().splitlines()
    for line in tail[-40:]:
        print("   |", line)
    summary = next((line for line in reversed(tail) if " passed" in line or " failed" in line or "error" in line
                    or "timed out" in line), "no summary")
    return {"returncode": code, "summary": summary, "seconds": time.perf_counter() - t0}


# -- 3. per model: exactness ----------------------------------------------------------------------
def rand_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab - 3) for _ in range(n)]  # (the folders' last three ids are special)


def one_sequence(runner, ids: list[int], start: int, blocks: list[int]):
    """A `SequenceInput` of `ids` at `start` on `blocks` (and, for a sliding-window model, the
    whole ring), for driving the runner directly."""
    from nextoken.runner.model_runner import SequenceInput

    sw = runner.kv.sliding
    return SequenceInput(ids, start, blocks, ring_ids=list(range(sw.ring_blocks)) if sw is not None else None)


def hf_model(folder: str, dtype):
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    return m.to(DEV).eval()


def exact_float32(folder: str, vocab: int) -> dict:
    """Our float32 logits (prefill, then 32 decode steps through the captured graphs) against
    transformers' float32 on the same card, TF32 off: max |ours - theirs| / max |theirs|."""
    import torch

    from nextoken import LLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    prompt = rand_ids(random.Random(1), 48, vocab)
    llm = LLM(folder, dtype="float32", **on_device(), max_num_seqs=2, max_model_len=256, gpu_memory_utilization=0.3)
    runner = llm.engine.runner
    hf = hf_model(folder, torch.float32)
    blocks = list(range(-(-(len(prompt) + 33) // runner.kv.block_size)))
    with torch.no_grad():
        out = hf(torch.tensor([prompt], device=DEV), use_cache=True)
        ref, past = out.logits[0].float(), out.past_key_values
        ours = runner.execute([one_sequence(runner, prompt, 0, blocks)], all_logits=True)
        errs = [float((ours - ref).abs().max() / ref.abs().max())]
        token = int(ref[-1].argmax())
        for step in range(32):
            out = hf(torch.tensor([[token]], device=DEV), past_key_values=past, use_cache=True)
            ref, past = out.logits[0, -1].float(), out.past_key_values
            mine = runner.execute([one_sequence(runner, [token], len(prompt) + step, blocks)])[0]
            errs.append(float((mine - ref).abs().max() / ref.abs().max()))
            token = int(ref.argmax())
    del llm, hf, runner
    return {"f32_prefill_rel": errs[0], "f32_decode_rel": max(errs[1:])}


def invariance_workload(vocab: int):
    """One request's prompt (40 ids), the 23 others of its batch, greedy parameters of 32 tokens."""
    from nextoken import SamplingParams

    rng = random.Random(2)
    prompt = rand_ids(rng, 40, vocab)
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    return prompt, [rand_ids(rng, rng.randint(8, 200), vocab) for _ in range(DRY["others"])], greedy


def exact_bf16(folder: str, vocab: int) -> dict:
    """Greedy bf16: our first 16 tokens against transformers' bf16 greedy ones; each of our 32 in
    transformers' top 5 at its step (teacher-forced on ours); and batch invariance (one request
    alone and among 23 others) in bf16 and float32; the bf16 tokens and the batch's time, for
    `invariant_mode`."""
    import torch

    from nextoken import LLM

    from nextoken import SamplingParams

    prompt, others, greedy = invariance_workload(vocab)
    out: dict = {}
    llm = LLM(folder, dtype="bfloat16", **on_device(), max_num_seqs=32, max_model_len=512, gpu_memory_utilization=0.3)
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=20))[0]
    ours, our_lps = list(first.outputs[0].token_ids), first.outputs[0].logprobs
    t0 = time.perf_counter()
    batch = llm.generate([prompt] + others, greedy)
    out["bf16_batch_s"], out["bf16_tokens"] = time.perf_counter() - t0, ours
    out["bf16_batch_invariant"] = list(batch[0].outputs[0].token_ids) == ours
    del llm, batch
    free()
    hf = hf_model(folder, torch.bfloat16)
    with torch.no_grad():
        ids = torch.tensor([prompt], device=DEV)
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                             do_sample=False, pad_token_id=vocab - 3)[0, len(prompt):].tolist()
        logits = hf(torch.tensor([prompt + ours], device=DEV)).logits[0, len(prompt) - 1 : len(prompt) + 31]
    top5 = logits.topk(5, dim=-1).indices.tolist()
    out["bf16_first16_equal"] = ours[:16] == theirs[:16]
    out["bf16_agree_prefix"] = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), 32)
    out["bf16_in_top5"] = sum(t in top for t, top in zip(ours, top5))
    i = out["bf16_agree_prefix"]
    if i < 32:  # where the two bf16 paths part: how far apart their tokens were in transformers' logits
        row = logits[i].float()
        out["bf16_split_gap_hf"] = float((row[theirs[i]] - row[ours[i]]) / row.abs().max())
    del hf
    free()
    out["bf16_lp_err"] = bf16_logprob_errors(folder, prompt, ours, our_lps, logits)
    e = out["bf16_lp_err"]
    log(f"   bf16 log-probabilities against transformers' float32 (teacher-forced on our 32 tokens, our top 20 "
        f"at each step): mean |error| ours {e['ours'][0]:.4f} (worst step {e['ours'][1]:.4f}), transformers' bf16 "
        f"{e['transformers'][0]:.4f} ({e['transformers'][1]:.4f})")
    llm = LLM(folder, dtype="float32", **on_device(), max_num_seqs=32, max_model_len=512, gpu_memory_utilization=0.3)
    if i < 32:  # and which of the two the float32 model picks there, by what margin (its log-probabilities)
        top = llm.generate([prompt + ours[:i]], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
        lp = top.outputs[0].logprobs[0]
        out["bf16_split_f32"] = {"f32_token": top.outputs[0].token_ids[0], "ours": ours[i], "theirs": theirs[i],
                                 "f32_logprob_ours": lp.get(ours[i]), "f32_logprob_theirs": lp.get(theirs[i])}
        log(f"   bf16 paths part at step {i}: ours {ours[i]}, transformers' {theirs[i]} (their logits: "
            f"{out['bf16_split_gap_hf']:.1e} of the largest apart); float32 picks {out['bf16_split_f32']['f32_token']}"
            f", log-probabilities ours {lp.get(ours[i])}, theirs {lp.get(theirs[i])}")
    alone = list(llm.generate([prompt], greedy)[0].outputs[0].token_ids)
    batch = llm.generate([prompt] + others, greedy)
    out["f32_batch_invariant"] = list(batch[0].outputs[0].token_ids) == alone
    del llm, batch
    return out


def bf16_logprob_errors(folder: str, prompt: list[int], ours: list[int], our_lps: list[dict], hf_bf16_logits) -> dict:
    """How far bf16 moves the log-probabilities from float32's, ours against transformers': at
    each of our greedy steps, the mean |bf16 - float32| log-probability over the tokens our step
    returned (its top 20 and its choice), float32 being transformers' float32 model (TF32 off)
    teacher-forced on the prompt and our tokens; ours from our decode steps, transformers' bf16
    from `hf_bf16_logits` (its teacher-forced logits ``[32, vocab]`` at the same positions).
    Returns ``{"ours": (mean over steps, worst step), "transformers": (...)}``."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    hf = hf_model(folder, torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + ours], device=DEV)).logits[0, len(prompt) - 1 : len(prompt) + 31]
        ref = torch.log_softmax(ref.float(), -1).cpu()
        theirs = torch.log_softmax(hf_bf16_logits.float(), -1).cpu()
    del hf
    free()
    errs: dict = {"ours": [], "transformers": []}
    for step, lps in enumerate(our_lps[:32]):
        ids = torch.tensor(list(lps))
        want = ref[step, ids]
        errs["ours"].append(float((torch.tensor(list(lps.values())) - want).abs().mean()))
        errs["transformers"].append(float((theirs[step, ids] - want).abs().mean()))
    return {k: (sum(v) / len(v), max(v)) for k, v in errs.items()}


def invariant_mode(folder: str, vocab: int, default: dict) -> dict:
    """bf16 with ``batch_invariant`` on `exact_bf16`'s workload: the request alone and in the
    batch, the batch's time over the default path's, and the leading tokens it shares with the
    default path's (`default`: `exact_bf16`'s results)."""
    from nextoken import LLM
    from nextoken.errors import InvalidRequest

    prompt, others, greedy = invariance_workload(vocab)
    ours, default_s = default["bf16_tokens"], default["bf16_batch_s"]
    try:
        llm = LLM(folder, dtype="bfloat16", **on_device(), max_num_seqs=32, max_model_len=512,
                  gpu_memory_utilization=0.3, batch_invariant=True)
    except InvalidRequest as exc:
        log(f"   batch-invariant mode: {exc}")
        return {"bf16_invariant_mode": None}
    alone = list(llm.generate([prompt], greedy)[0].outputs[0].token_ids)
    t0 = time.perf_counter()
    batch = llm.generate([prompt] + others, greedy)
    out = {"bf16_invariant_mode": list(batch[0].outputs[0].token_ids) == alone,
           "bf16_invariant_time": (time.perf_counter() - t0) / default_s,
           "bf16_invariant_agree": next((i for i, (a, b) in enumerate(zip(alone, ours)) if a != b), len(ours))}
    log(f"   bf16 --batch-invariant: alone = in the batch {out['bf16_invariant_mode']}, the batch in "
        f"{out['bf16_invariant_time']:.2f}x the default path's time, first {out['bf16_invariant_agree']} tokens "
        "as the default path's")
    del llm, batch
    free()
    return out


# -- 3. per model: speed ----------------------------------------------------------------------------
def model_facts(runner) -> dict:
    """Weight bytes a decode step reads, matmul parameters per token, KV bytes per token."""
    cfg = runner.config
    linears = sum(m.weight.numel() for name, m in runner.model.named_modules()
                  if type(m).__name__ == "Linear" and m.weight is not None)
    return {"decode_weight_bytes": runner.decode_weight_bytes, "matmul_params": linears,
            "kv_bytes_per_token": runner.kv.bytes_per_token, "layers": cfg.num_layers, "heads": cfg.num_heads,
            "head_dim": cfg.head_dim, "full_layers": len(cfg.full_layers), "window": cfg.sliding_window or 0}


def attention_flops(facts: dict, queries: int, keys: float) -> float:
    """2 products (q k, p v) of 2 flops per (query, key, head, dim), over the full-attention
    layers (sliding layers see at most their window)."""
    per_layer = 4 * facts["heads"] * facts["head_dim"] * queries
    full = facts["full_layers"] * keys
    sliding = (facts["layers"] - facts["full_layers"]) * min(keys, facts["window"] or keys)
    return per_layer * (full + sliding)


def speed(folder: str, vocab: int, limits: dict, profile_to: str | None = None) -> dict:
    """The speed rows of one model (see the module docstring); with `profile_to` (the first
    model), also where a decode step's time goes (`profile`), its full tables into that file."""

    from nextoken import LLM, SamplingParams

    bw, rate = limits["bandwidth"], limits["bf16_rate"]
    out: dict = {}
    n_tok, batch, plen, n_pre = DRY["speed_tokens"], DRY["batch"], DRY["prompt"], DRY["prefill"]
    llm = LLM(folder, dtype="bfloat16", **on_device(), max_num_seqs=batch, max_model_len=n_pre + 512,
              gpu_memory_utilization=0.6, max_num_batched_tokens=8192)
    runner = llm.engine.runner
    facts = model_facts(runner)
    out.update(facts)
    log("   " + runner.plan.describe(runner.model))
    if runner.plan.sampling_times:  # (the plan's timing of the Triton draw against PyTorch's, at load)
        out["draw_timed"] = {b: [1000 * t for t in ts] for b, ts in runner.plan.sampling_times.items()}
        log("   the draw timed at load (rows: Triton / PyTorch ms, top-p 0.95): " + ", ".join(
            f"{b}: {ours:.3f} / {theirs:.3f}" for b, (ours, theirs) in out["draw_timed"].items()))
    if runner.plan.tiling_times:  # (the attention's tiles timed at load: query rows x keys / warps, us)
        out["tiles_timed"] = {kind: {t: round(1e6 * v, 1) for t, v in times.items()}
                              for kind, times in runner.plan.tiling_times.items() if kind != "join"}
        log(f"   the attention's tiles timed at load (us over two layers; decodes: 64 x 640 keys + 1 x 1024; "
            f"prefill: 2048 queries): {out['tiles_timed']}")
        if runner.plan.tiling_times.get("join"):  # (a decode's key splits joined in its launch or a second one)
            out["join_timed"] = {n: {way: round(1e6 * s, 1) for way, s in ways.items()}
                                 for n, ways in runner.plan.tiling_times["join"].items()}
            log(f"   the decodes' key splits joined in the attention's launch or a second one, timed at load (us over "
                f"two layers; 4 splits: 64 decodes, 16: one): {out['join_timed']}")
        try:
            out["tiles_rates"] = tile_rates(runner)
            log(f"   as rates (decodes: keys and values read, TB/s; prefill: TFLOP/s): {out['tiles_rates']}")
        except Exception as exc:  # noqa: BLE001 - a figure of the log, not of the check
            log(f"   the tiles' rates failed: {type(exc).__name__}: {exc}")
    rng = random.Random(3)
    prompt = rand_ids(rng, DRY["b1_prompt"], vocab)
    b1 = (("greedy", SamplingParams(temperature=0, max_tokens=n_tok, ignore_eos=True)),
          ("sampled", SamplingParams(temperature=0.8, top_p=0.95, seed=1, max_tokens=n_tok, ignore_eos=True)))
    for name, params in b1:
        llm.generate([prompt], params)  # warm
        tpots = [llm.generate([prompt], params)[0].metrics.tpot for _ in range(DRY["reps"])]
        out[f"b1_{name}_tok_s"] = 1 / statistics.median(tpots)
    roof = (facts["decode_weight_bytes"] + facts["kv_bytes_per_token"] * (DRY["b1_prompt"] + n_tok // 2)) / bw
    out["b1_roofline_tok_s"] = 1 / roof
    out["b1_share"] = out["b1_greedy_tok_s"] / out["b1_roofline_tok_s"]
    log(f"   batch 1: {out['b1_greedy_tok_s']:.0f} tok/s greedy, {out['b1_sampled_tok_s']:.0f} sampled; roofline "
        f"{out['b1_roofline_tok_s']:.0f} ({100 * out['b1_share']:.0f}%)")

    prompts = [rand_ids(rng, plen, vocab) for _ in range(batch)]
    b64 = (("greedy", SamplingParams(temperature=0, max_tokens=n_tok, ignore_eos=True)),
           ("sampled", SamplingParams(temperature=0.8, top_p=0.95, seed=2, max_tokens=n_tok, ignore_eos=True)))
    tokens = {}
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # (compiles its shapes)
    for name, params in b64:
        out[f"b64_{name}_step_ms"], out[f"b64_{name}_out_tok_s"], tokens[name], _ = decode_steps(llm, prompts, params)
    try:  # (a fault here keeps the rows above and below)
        sampler = llm.engine.sampler
        if sampler.triton_draw is not None:  # the same sampled run on PyTorch's draw
            draw, sampler.triton_draw = sampler.triton_draw, None
            try:
                out["b64_torch_draw_sampled_step_ms"] = decode_steps(llm, prompts, b64[1][1])[0]
            finally:
                sampler.triton_draw = draw
            log(f"   64 x (512 + 256) sampled step on the Triton draw {out['b64_sampled_step_ms']:.2f} ms, on "
                f"PyTorch's {out['b64_torch_draw_sampled_step_ms']:.2f} ms")
        out.update(draw_agreement(vocab))
    except Exception as exc:  # noqa: BLE001
        out["draw_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        log("   the draw's A/B FAILED:", out["draw_error"])
        traceback.print_exc()
    ctx = plen + n_tok // 2  # the mean context over the decode
    step_bytes = facts["decode_weight_bytes"] + batch * ctx * facts["kv_bytes_per_token"]
    step_flops = 2 * facts["matmul_params"] * batch + attention_flops(facts, batch, ctx)
    out["b64_roofline_ms"] = 1000 * max(step_bytes / bw, step_flops / rate)
    out["b64_ratio"] = out["b64_greedy_step_ms"] / out["b64_roofline_ms"]
    log(f"   64 x (512 + 256): decode step {out['b64_greedy_step_ms']:.2f} ms greedy, {out['b64_sampled_step_ms']:.2f} "
        f"sampled; roofline {out['b64_roofline_ms']:.2f} ms ({out['b64_ratio']:.1f}x)")
    graphs = runner.graphs
    if graphs is not None and graphs.graphs.get(batch, (None,))[0] is not None:
        # the pass alone on the GPU (the captured 64-decode graph over its last inputs): the step
        # less this is the host's part (inputs, LM head, draw, detokenizing, scheduling)
        out["b64_graph_ms"] = 1000 * cuda_time(graphs.graphs[batch][0].replay, 20, 3)
        log(f"   the 64-decode graph alone: {out['b64_graph_ms']:.2f} ms on the GPU")
    # the same engine with async scheduling (the host's work for a step while the GPU runs the next)
    llm.engine.async_scheduling = True
    try:  # (a fault here keeps the in-order figures above, and the serving section runs in order)
        for name, params in b1:
            tpots = [llm.generate([prompt], params)[0].metrics.tpot for _ in range(DRY["reps"])]
            out[f"b1_async_{name}_tok_s"] = 1 / statistics.median(tpots)
        for name, params in b64:
            out[f"b64_async_{name}_step_ms"], out[f"b64_async_{name}_out_tok_s"], got, \
                out[f"b64_async_{name}_wait_ms"] = decode_steps(llm, prompts, params)
            out[f"b64_async_{name}_same_tokens"] = sum(a == b for a, b in zip(got, tokens[name])) / len(got)
    except Exception as exc:  # noqa: BLE001
        out["async_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        log("   async scheduling FAILED:", out["async_error"])
        traceback.print_exc()
    finally:
        llm.engine.async_scheduling = False
    if "async_error" not in out:
            log(f"   async scheduling: batch 1 {out['b1_async_greedy_tok_s']:.0f} tok/s greedy, "
            f"{out['b1_async_sampled_tok_s']:.0f} sampled; 64 x (512 + 256) {out['b64_async_greedy_out_tok_s']:.0f} "
            f"output tok/s greedy (in order {out['b64_greedy_out_tok_s']:.0f}), "
            f"{out['b64_async_sampled_out_tok_s']:.0f} sampled (in order {out['b64_sampled_out_tok_s']:.0f}); the "
            f"in-order run's tokens in {100 * out['b64_async_greedy_same_tokens']:.0f}% / "
            f"{100 * out['b64_async_sampled_same_tokens']:.0f}% of the requests; a greedy step waited "
            f"{out['b64_async_greedy_wait_ms']:.2f} ms of its {out['b64_async_greedy_step_ms']:.2f} for the device")

    n = n_pre
    blocks = list(range(-(-n // runner.kv.block_size)))
    ids = rand_ids(rng, n, vocab)
    t = cuda_time(lambda: runner.execute([one_sequence(runner, ids, 0, blocks)]), 3, 1)
    flops = 2 * facts["matmul_params"] * n + attention_flops(facts, n, n / 2)
    out["prefill4096_ms"] = 1000 * t
    out["prefill4096_share"] = flops / t / rate
    log(f"   prefill 4096: {1000 * t:.1f} ms, {flops / t / 1e12:.0f} TFLOP/s, {100 * out['prefill4096_share']:.0f}% of "
        "the bf16 rate")
    try:  # (how much of that the GPU was busy: the rest is the host launching the layers' kernels eagerly)
        out.update(busy := busy_share(lambda: runner.execute([one_sequence(runner, ids, 0, blocks)]), "prefill4096"))
        if busy:
            log(f"   prefill 4096: the GPU busy {out['prefill4096_busy_ms']:.1f} ms of {out['prefill4096_wall_ms']:.1f} "
                f"({out['prefill4096_kernels']} kernels); the host's ops by own time: "
                + "; ".join(f"{ms:.2f} ms x{c} {k[:50]}" for k, ms, c in out["prefill4096_host_ops"]))
            out["prefill4096_python"] = host_top(lambda: runner.execute([one_sequence(runner, ids, 0, blocks)]))
            log("   prefill 4096: its Python by own time (cProfile): "
                + "; ".join(f"{ms:.2f} ms x{c} {where}" for where, ms, c in out["prefill4096_python"]))
    except Exception as exc:  # noqa: BLE001 - a figure of the log, not of the check
        log(f"   prefill 4096: profiling it failed: {type(exc).__name__}: {exc}")
    out["kernel_fallbacks"] = runner.plan.kernels.fallbacks.snapshot()  # (calls a plan's kernel refused: PyTorch ran)
    log(f"   kernel fallbacks over the speed runs: {out['kernel_fallbacks'] or 'none'}")
    if profile_to is not None:
        for name, fn in (("profile", lambda: profile(llm, vocab, profile_to)),
                         ("rowwise", lambda: rowwise_ab(llm, prompt, prompts, b1[0][1], b64[0][1], out))):
            try:
                out.update(fn())
            except Exception as exc:  # noqa: BLE001 - the speed rows above stand
                out[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                log(f"   {name} FAILED:", out[f"{name}_error"])
                traceback.print_exc()
    return out


def draw_agreement(vocab: int) -> dict:
    """The Triton draw's tokens against the PyTorch draw's (`sample.sampler.torch_draw`) on 64 rows
    (4 in a dry run) of the model's vocabulary, flat (random logits of spread 2, as a
    random-weight model's) and peaked (spread 8), under top-p 0.95, top-k 50 with top-p 0.9, and
    min-p 0.05, over 8 draws (1 in a dry run) of random uniform numbers each: the share that
    agree (1 unless a uniform number or top-p falls within float64's rounding of a boundary), and
    each draw's GPU time."""
    import torch

    from nextoken.kernels.gpu.sampling import draw_rows
    from nextoken.sample.sampler import torch_draw

    g = torch.Generator().manual_seed(7)
    b, draws = (64, 8) if DEV == "cuda" else (4, 1)  # (a dry run: Triton's interpreter)
    agree, n, times = 0, 0, {"triton": [], "torch": []}
    for spread in (2.0, 8.0):
        rows = (torch.randn(b, vocab, generator=g) * spread).to(DEV)
        for k, p, mp in ((0, 0.95, 0.0), (50, 0.9, 0.0), (0, 1.0, 0.05)):
            T = torch.full((b,), 0.8, device=DEV)
            K = torch.full((b,), k, dtype=torch.int32, device=DEV)
            P, M = torch.full((b,), p, device=DEV), torch.full((b,), mp, device=DEV)
            for _ in range(draws):
                u = torch.rand(b, generator=g).to(DEV)
                times["triton"].append(cuda_time(lambda: draw_rows(rows, T, K, P, M, u), 1, 1))
                times["torch"].append(cuda_time(lambda: torch_draw(rows, T, K, P, M, u, list(range(b)), True), 1, 1))
                agree += int((draw_rows(rows, T, K, P, M, u) == torch_draw(rows, T, K, P, M, u)).sum())
                n += b
    out = {"draw_agree": agree / n, "draw_triton_ms": 1000 * statistics.median(times["triton"]),
           "draw_torch_ms": 1000 * statistics.median(times["torch"])}
    log(f"   the Triton draw against PyTorch's on {b} rows of {vocab}: {agree} of {n} tokens the same; median "
        f"{out['draw_triton_ms']:.3f} against {out['draw_torch_ms']:.3f} ms a draw")
    # its scratch (the default: each row's keys and e^x written once, read back by ~20 passes) against
    # recomputing them every pass, at 1 and at b rows, top-p 0.95: the times and the same tokens
    cmp, same = {}, True
    for rows_n in (1, b):
        rows = (torch.randn(rows_n, vocab, generator=g) * 2).to(DEV)
        T, P = torch.full((rows_n,), 0.8, device=DEV), torch.full((rows_n,), 0.95, device=DEV)
        K, M = torch.zeros(rows_n, dtype=torch.int32, device=DEV), torch.zeros(rows_n, device=DEV)
        u = torch.rand(rows_n, generator=g).to(DEV)
        cmp[rows_n] = [1000 * cuda_time(lambda: draw_rows(rows, T, K, P, M, u, cached=c), 3, 1) for c in (True, False)]
        same &= bool((draw_rows(rows, T, K, P, M, u) == draw_rows(rows, T, K, P, M, u, cached=False)).all())
    out["draw_cached_ms"] = cmp
    log("   the Triton draw with its scratch against recomputing each pass (ms, top-p 0.95): "
        + ", ".join(f"{r} rows {a:.3f} / {c:.3f}" for r, (a, c) in cmp.items()) + f"; the same tokens: {same}")
    return out


KERNEL_SLOTS = ("act_kernel", "norm_kernel", "qk_norm_kernel", "rope_kernel", "qkv", "gate_up")


def weight_rates(runner) -> dict:
    """Per weight shape, the weight bytes a timing read (the shape's weights, every layer's) over
    the fastest launch's time and over cuBLAS's, in TB/s: ``{"gemv"|"skinny": {"NxK": (ours,
    cuBLAS)}}`` (`ExecutionPlan.gemv_times` and `skinny_times`)."""
    from nextoken.layers.linear import gemv_targets

    count: dict = {}
    for t in gemv_targets(runner.model):
        key = (tuple(t.weight.shape), t.bias is not None)
        count[key] = count.get(key, 0) + t.weight.numel() * t.weight.element_size()
    out = {}
    for name in ("gemv", "skinny"):
        for key, times in getattr(runner.plan, f"{name}_times").items():
            ours = min(v for k, v in times.items() if k != "torch")
            out.setdefault(name, {})[f"{key[0][0]}x{key[0][1]}"] = (round(count[key] / ours / 1e12, 2),
                                                                    round(count[key] / times["torch"] / 1e12, 2))
    return out


def tile_rates(runner) -> dict:
    """The attention tiles' timings at load as rates: the decodes' key and value bytes (two layers
    of 64 x 640 + 1 x 1024 keys) in TB/s, the prefill's products (two layers of a causal
    2048-token chunk) in TFLOP/s, per tile (`ExecutionPlan.tiling_times`)."""
    cfg = runner.model.config
    kv_bytes = 2 * (64 * 640 + 1024) * 2 * cfg.num_kv_heads * cfg.head_dim * runner.dtype.itemsize
    flops = 2 * 4 * cfg.num_heads * cfg.head_dim * 2048 * 2048 / 2
    times = runner.plan.tiling_times
    return {"decode_tb_s": {t: round(kv_bytes / s / 1e12, 2) for t, s in times.get("decode", {}).items()},
            "prefill_tflop_s": {t: round(flops / s / 1e12) for t, s in times.get("prefill", {}).items()}}


def rowwise_ab(llm, prompt, prompts, b1_params, b64_params, measured: dict) -> dict:
    """The plan's own kernels against PyTorch's on the same engine, in two stages, the decode
    graphs captured again for each and batch-1 greedy decode and the 64-sequence greedy step
    measured as above (the plan's figures are `measured`'s): first the GEMV and the split-K GEMM
    off (every matmul on cuBLAS; `kernels.gpu.gemv`, `kernels.gpu.skinny`), then also the
    row-wise kernels (`kernels.gpu.rowwise`) and fused projections (`layers.linear.FusedLinear`)
    off (PyTorch's expressions and separate matmuls)."""
    from nextoken.layers.linear import gemv_targets

    runner = llm.engine.runner
    if not runner.plan.rowwise:
        return {}
    out = {"gemv_shapes": list(runner.plan.gemv_shapes), "skinny_shapes": list(runner.plan.skinny_shapes),
           "gemv_rows": sorted({(t.weight.shape[0], t.weight.shape[1], t.gemv_rows, str(t.gemv_launch), t.skinny_rows,
                                 str(t.skinny_launch)) for t in gemv_targets(runner.model)})}
    for name in ("gemv", "skinny"):
        out[f"{name}_times"] = {f"{key[0][0]}x{key[0][1]}": {k: round(v * 1e6, 1) for k, v in times.items()}
                                for key, times in getattr(runner.plan, f"{name}_times").items()}
    log(f"   GEMV and split-K GEMM chosen per weight shape (out, in, GEMV up to rows, its launch, GEMM at rows, its "
        f"launch): {out['gemv_rows']}")
    log(f"   the GEMV's launches timed at one row per weight shape (us over the model's weights of the shape; launch: "
        f"tile/warps/programs per SM): {out['gemv_times']}")
    for name, what in (("silu", "SiLU inside the down projection's GEMV against its own launch, then the GEMV"),
                       ("rope", "RoPE and the cache's write inside the q/k/v GEMV against the GEMV, then the RoPE "
                                "kernel"),
                       ("norm", "the residual add and RMSNorm inside the o and down projections' GEMV (joined by its "
                                "last program) against the GEMV, then the add-norm kernel")):
        out[f"{name}_us"] = {f"{k[0]}x{k[1]}": {way: round(v * 1e6, 1) for way, v in t.items()}
                             for k, t in getattr(runner.plan, f"{name}_times").items()}
        log(f"   {what}, at one row (us over the model's weights of the shape; rows taken "
            f"{getattr(runner.plan, f'{name}_rows')}): {out[f'{name}_us']}")
    log(f"   the split-K GEMM's launches timed at 64 rows (us; launch: N tile x K step/warps/stages/programs per SM): "
        f"{out['skinny_times']}")
    out["matmul_tb_s"] = weight_rates(runner)
    log(f"   their weight reads, the fastest launch against cuBLAS (TB/s; GEMV at 1 row, GEMM at 64): {out['matmul_tb_s']}")
    for stage in ("no_gemv", "torch_rows"):
        if stage == "no_gemv":
            for t in gemv_targets(runner.model):
                t.gemv_rows, t.skinny_rows, t.silu_rows, t.rope_rows, t.norm_rows = 0, (), 0, 0, 0
        else:
            for m in runner.model.modules():
                for slot in KERNEL_SLOTS:
                    if hasattr(m, slot):
                        setattr(m, slot, None)
        if runner.graphs is not None:
            sizes, length = runner.graphs.sizes[-1], (runner.graphs.max_blocks - 1) * runner.kv.block_size
            runner.graphs = None
            free()
            runner.capture_decode_graphs(sizes, length)
        llm.generate([prompt], b1_params)  # warm
        tpots = [llm.generate([prompt], b1_params)[0].metrics.tpot for _ in range(DRY["reps"])]
        out[f"b1_{stage}_greedy_tok_s"] = 1 / statistics.median(tpots)
        out[f"b64_{stage}_greedy_step_ms"] = decode_steps(llm, prompts, b64_params)[0]
    log(f"   the plan's kernels against cuBLAS alone (GEMV and GEMM off) and PyTorch's rows and separate matmuls too: batch 1 "
        f"{measured['b1_greedy_tok_s']:.0f} / {out['b1_no_gemv_greedy_tok_s']:.0f} / {out['b1_torch_rows_greedy_tok_s']:.0f}"
        f" tok/s greedy; 64 x (512 + 256) step {measured['b64_greedy_step_ms']:.2f} / {out['b64_no_gemv_greedy_step_ms']:.2f}"
        f" / {out['b64_torch_rows_greedy_step_ms']:.2f} ms")
    return out


def profile(llm, vocab: int, path: str) -> dict:
    """Where a decode step's time goes, for the speed goals' causes: the batch-1 graph alone on
    the GPU (the step's device part), the host's Python over batch-1 greedy decodes (cProfile,
    by own time), and PyTorch's profiler (CPU and CUDA) over batch-1 greedy decodes and over 64
    short requests, greedy and sampled: each kernel's device time a step, and the host's own time per
    operator (synchronizations included). Full tables into `path`; the heads into the log."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from nextoken import SamplingParams

    out: dict = {}
    runner, rng = llm.engine.runner, random.Random(5)
    graphs = runner.graphs
    if graphs is not None and graphs.graphs.get(1, (None,))[0] is not None:
        out["b1_graph_ms"] = 1000 * cuda_time(graphs.graphs[1][0].replay, 50, 5)
        log(f"   profile: the 1-decode graph alone: {out['b1_graph_ms']:.3f} ms on the GPU")
        try:  # (a profiler that cannot trace a graph's replay must not cost the rest of the profile)
            out.update(graph_launches(graphs.graphs[1][0], out["b1_graph_ms"]))
        except Exception as exc:  # noqa: BLE001
            log(f"   profile: counting the graph's kernels failed: {type(exc).__name__}: {exc}")
    n = max(8, DRY["speed_tokens"] // 4)
    greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    prompt = rand_ids(rng, DRY["b1_prompt"], vocab)
    llm.generate([prompt], greedy)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    llm.generate([prompt], greedy)
    prof.disable()
    out["b1_host_ms_per_token"] = 1000 * (time.perf_counter() - t0) / n
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(40)
    rows = sorted(((st[2], f"{os.path.basename(fn)}:{ln} {name}") for (fn, ln, name), st in stats.stats.items()),
                  reverse=True)[:12]
    out["b1_host_top"] = [(where, 1000 * tt / n) for tt, where in rows]
    log(f"   profile: batch-1 greedy under cProfile {out['b1_host_ms_per_token']:.2f} ms a token; own time a token: "
        + "; ".join(f"{ms:.3f} ms {where}" for where, ms in out["b1_host_top"]))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
    tables = [text.getvalue()]
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=n, ignore_eos=True)
    short = [rand_ids(rng, 16, vocab) for _ in range(DRY["batch"])]
    for tag, prompts, params in (("b1_greedy", [prompt], greedy), ("b64_greedy", short, greedy),
                                 ("b64_sampled", short, sampled)):
        with torch_profile(activities=acts) as tp:
            llm.generate(prompts, params)
        sync()
        events = tp.key_averages()
        dev = [(getattr(e, "self_device_time_total", 0) or 0, e.key, e.count) for e in events]
        dev = sorted((d for d in dev if d[0] > 0), reverse=True)
        host = sorted(((e.self_cpu_time_total, e.key, e.count) for e in events), reverse=True)
        out[f"{tag}_device_ms_per_step"] = sum(d[0] for d in dev) / 1000 / n
        out[f"{tag}_kernels"] = [(k, us / 1000 / n, c / n) for us, k, c in dev[:12]]
        out[f"{tag}_host_ops"] = [(k, us / 1000 / n, c / n) for us, k, c in host[:12]]
        log(f"   profile {tag}: device {out[f'{tag}_device_ms_per_step']:.3f} ms a step; kernels a step: "
            + "; ".join(f"{ms:.3f} ms x{c:.0f} {k[:60]}" for k, ms, c in out[f"{tag}_kernels"][:10]))
        log(f"   profile {tag}: host ops' own time a step: "
            + "; ".join(f"{ms:.3f} ms x{c:.0f} {k[:50]}" for k, ms, c in out[f"{tag}_host_ops"][:10]))
        sort = "self_cuda_time_total" if DEV == "cuda" else "self_cpu_time_total"
        tables.append(f"== {tag}\n" + events.table(sort_by=sort, row_limit=40, max_name_column_width=90))
    with open(path, "w") as f:
        f.write("\n\n".join(tables))
    return out


def busy_share(fn, tag: str) -> dict:
    """One call of `fn` under PyTorch's profiler: its wall time (synchronized), the device time of
    its kernels summed, and how many: where the first is much the larger, the host's launches, not
    the GPU, set the pace (eager passes of a small model). Empty off a GPU."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    if DEV != "cuda":
        return {}
    sync()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        t0 = time.perf_counter()
        fn()
        sync()
        wall = time.perf_counter() - t0
    kernels = [e for e in tp.events() if e.device_type == DeviceType.CUDA and (e.device_time_total or 0) > 0]
    host = sorted(((e.self_cpu_time_total, e.key, e.count) for e in tp.key_averages()), reverse=True)[:8]
    return {f"{tag}_wall_ms": 1000 * wall, f"{tag}_busy_ms": sum(e.device_time_total for e in kernels) / 1000,
            f"{tag}_kernels": len(kernels), f"{tag}_host_ops": [(k, us / 1000, c) for us, k, c in host]}


def host_top(fn, rows: int = 10) -> list[tuple[str, float, int]]:
    """One call of `fn` under cProfile: its Python functions by own time, (where, ms, calls)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    sync()
    prof.disable()
    stats = pstats.Stats(prof).stats
    top = sorted(((st[2], f"{os.path.basename(fn_)}:{ln} {name}", st[1]) for (fn_, ln, name), st in stats.items()),
                 reverse=True)[:rows]
    return [(where, 1000 * tt, calls) for tt, where, calls in top]


def graph_launches(graph, graph_ms: float, replays: int = 20) -> dict:
    """The kernels of one replay of a captured decode graph (PyTorch's profiler over `replays`
    replays): how many, their summed device time, and the rest of the graph's time (`graph_ms`,
    timed alone) spread over them: what each launch costs beyond its own work (the gap and
    ramp between kernels), which decides whether folding launches pays. Empty when the profiler
    sees no kernel inside a replay."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    sync()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        for _ in range(replays):
            graph.replay()
        sync()
    kernels = [e for e in tp.events() if e.device_type == DeviceType.CUDA and (e.device_time_total or 0) > 0]
    if not kernels:
        log("   profile: the profiler saw no kernel inside the graph's replays")
        return {}
    count = len(kernels) / replays
    busy_ms = sum(e.device_time_total for e in kernels) / 1000 / replays
    out = {"b1_graph_kernels": count, "b1_graph_busy_ms": busy_ms,
           "b1_graph_gap_us": 1000 * max(0.0, graph_ms - busy_ms) / count}
    log(f"   profile: the 1-decode graph runs {count:.0f} kernels, busy {busy_ms:.3f} ms of its {graph_ms:.3f} ms: "
        f"{out['b1_graph_gap_us']:.2f} us between kernels a launch")
    return out


def decode_steps(llm, prompts: list[list[int]], params) -> tuple[float, float, list[list[int]], float]:
    """`prompts` through `llm` at once: the median milliseconds of a step whose decodes are the
    whole batch (the step's wall: under async scheduling the period between steps), output tokens
    a second over the whole run, each request's tokens, and the median milliseconds such a step
    waited for the device's tokens (async scheduling; 0 in order)."""
    steps: list[tuple[int, float, float]] = []
    llm.engine.subscribe(lambda st: steps.append((len(st.decode), st.ms, st.wait_ms)) if not st.prefill else None)
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, params)
    finally:
        llm.engine.subscribers.pop()
    wall = time.perf_counter() - t0
    full = [(ms, wait) for n, ms, wait in steps if n == len(prompts)]
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    if not full:
        return float("nan"), sum(map(len, tokens)) / wall, tokens, float("nan")
    return (statistics.median(ms for ms, _ in full), sum(map(len, tokens)) / wall, tokens,
            statistics.median(wait for _, wait in full))


# -- 3. serving ---------------------------------------------------------------------------------------
def serving(folder: str, vocab: int, out_dir: str | None, num_requests: int = 256, stream_interval: int = 1,
            async_scheduling: bool = False, engine_process: bool = False, api_servers: int = 1) -> dict:
    import httpx

    import serve as serve_bench

    port = 8123
    logf = open(os.path.join(out_dir, f"serve{'-engine-process' if engine_process else ''}.log") if out_dir
                else os.devnull, "w")
    where = ["--device", "cuda"] if DEV == "cuda" else ["--device", "cpu", "--enforce-eager", "--attention-backend",
                                                         "triton"]
    cmd = [sys.executable, "-m", "nextoken.cli", "serve", "--model", folder, *where, "--port", str(port),
           "--max-num-seqs", "256", "--max-model-len", "2048", "--max-num-batched-tokens", "8192",
           "--gpu-memory-utilization", "0.85", "--log-level", "info", "--stream-interval", str(stream_interval),
           "--async-scheduling" if async_scheduling else "--no-async-scheduling",
           *(["--engine-process"] if engine_process else []),
           *(["--api-server-count", str(api_servers)] if engine_process and api_servers > 1 else [])]
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    try:
        while time.perf_counter() - t0 < 240:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} (see serve.log)")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        else:
            raise RuntimeError("the server did not become healthy in 240 s")
        started = time.perf_counter() - t0
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        smoke = server_smoke(url, model, vocab)
        log(f"   the server on the GPU: {smoke}")
        rng = random.Random(4)
        top = 1024 if DEV == "cuda" else 24
        reqs = [(rand_ids(rng, rng.randint(top // 10, top), vocab), rng.randint(top // 10, top))
                for _ in range(num_requests)]
        before, cpu_before = engine_metrics(url), process_cpu(proc.pid)
        spies = spy_on(serving_pids(proc.pid), 8, out_dir, "-engine-process" if engine_process else "")
        procs = serve_bench.default_client_procs() if DEV == "cuda" else 2  # (two here: the dry run tries the path)
        results, wall, client_cpu = serve_bench.run_load(url, model, math.inf, reqs, 4, 0.0, procs)
        cpu_client = {f"client x{procs}": client_cpu / procs}
        engine = {k: v - before.get(k, 0.0) for k, v in engine_metrics(url).items()}
        cpu = {k: v - cpu_before.get(k, 0.0) for k, v in process_cpu(proc.pid).items()}
        spied = spy_results(spies)
        ok = [r for r in results if "error" not in r]
        errors = sorted({r["error"] for r in results if "error" in r})
        tokens = sum(r["out"] for r in ok)
        ttft = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
        steps, busy = engine.get("nextoken_step_duration_seconds_count", 0), engine.get("nextoken_step_duration_seconds_sum", 0)
        out = {"serve_smoke": smoke, "serve_start_s": started, "serve_ok": len(ok), "serve_errors": errors,
               "serve_stream_interval": stream_interval, "serve_async_scheduling": async_scheduling,
               "serve_engine_process": engine_process,
               "serve_api_servers": api_servers if engine_process else 1,
               "serve_wall_s": wall,
               "serve_workload": [(len(p), n) for p, n in reqs],  # (prompt and output lengths: `serving_roofline`)
               "serve_out_tok_s": tokens / wall, "serve_ttft_p50_s": ttft[len(ttft) // 2] if ttft else None,
               # the server's side (its /metrics): how much of the wall its engine thread stepped, and
               # its mean step; a busy share well below 1 puts the limit in the HTTP layer or the client
               "serve_engine_steps": steps, "serve_engine_busy": busy / wall if wall else None,
               "serve_mean_step_ms": 1e3 * busy / steps if steps else None,
               # async scheduling: the share of the wall the engine waited for the device's tokens
               # (near the busy share: the GPU sets the pace; near 0: the host does)
               "serve_device_wait": engine.get("nextoken_device_wait_seconds_total", 0) / wall if wall else None,
               # the CPU each process spent during the run, as a share of the wall: the server's near 1
               # (one core's worth of Python) bounds the serving; with --engine-process, so can the engine's
               # (the load client's: per client process, near 1 when the client sets the pace)
               "serve_cpu_share": {k: v / wall for k, v in {**cpu, **cpu_client}.items()} if wall else None,
               # where each process's Python spent its samples (py-spy, when it came along): the
               # leaf frames' shares, the top ones
               "serve_spy": spied}
        log(f"   serving: healthy after {started:.0f} s; {len(ok)}/{num_requests} ok {errors or ''}, {tokens} "
            f"tokens in "
            f"{wall:.1f} s = {tokens / wall:.0f} output tok/s; the engine stepped {out['serve_engine_busy'] or 0:.0%} "
            f"of the wall ({steps:.0f} steps, {out['serve_mean_step_ms'] or 0:.2f} ms each), waited for the device "
            f"{out['serve_device_wait'] or 0:.0%} of it; CPU per process over the wall "
            f"{ {k: round(v, 2) for k, v in (out['serve_cpu_share'] or {}).items()} }")
        for name, tops in spied.items():
            for kind, top in tops.items():
                log(f"   py-spy, {name}, {kind}: " + "; ".join(f"{share:.0%} {place}" for place, share in top[:8]))
        late = late_compiles(logf.name) if out_dir else []
        out["serve_late_compiles"] = late
        if late:  # (`kernels.gpu.compiles`: Triton compiling a shape the warm-up never met, while serving)
            log(f"   Triton compiled {len(late)} kernels after the warm-up, {sum(t for _, t, _ in late):.1f} s: "
                + "; ".join(f"{name} {t:.2f} s" for name, t, _ in late[:8]))
        return out
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        logf.close()


def spawned(pid: int) -> dict[str, int]:
    """The processes the server `pid` started with `multiprocessing`, by role: "engine" (its
    engine process) and, with --api-server-count, "api0", "api1", ... (the server processes,
    which hold the listening socket)."""
    def holds_tcp(p: int) -> bool:
        inodes = set()
        for fd in os.listdir(f"/proc/{p}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{p}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        with open("/proc/net/tcp") as a, open("/proc/net/tcp6") as b:
            tcp = a.read() + b.read()
        return any(f" {i} " in tcp for i in inodes)

    out, k = {}, 0
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in sorted(map(int, f.read().split())):
                    with open(f"/proc/{child}/cmdline", "rb") as c:
                        if b"spawn_main" not in c.read():
                            continue
                    if holds_tcp(child):
                        out[f"api{k}"], k = child, k + 1
                    else:
                        out["engine"] = child
    return out


def late_compiles(path: str) -> list[tuple[str, float, str]]:
    """The server log's Triton compilations after its warm-up (`kernels.gpu.compiles`): (kernel,
    seconds, its specialization) each."""
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            m = re.search(r"Triton compiled (\S+) in ([0-9.]+) s after the engine was ready: (.*)", line)
            if m:
                out.append((m.group(1), float(m.group(2)), m.group(3)[:300]))
    return out


def serving_roofline(workload: list, facts: dict, limits: dict) -> float:
    """The most output tokens/s any engine could reach on the serving section's requests on this
    card (`workload`: their (prompt, output) lengths, all sent at once): each prompt's prefill at
    the measured bf16 matrix rate, then one decode step per output position, each step taking
    the longer of its reads (the weights once, every running request's keys and values so far)
    at the measured bandwidth and its FLOPs at the matrix rate. Prefill and decode never overlap
    here, nor does anything else cost: a bound, not an estimate."""
    bw, rate = limits["bandwidth"], limits["bf16_rate"]
    t = sum(2 * facts["matmul_params"] * p + attention_flops(facts, p, p / 2) for p, _ in workload) / rate
    for step in range(max(n for _, n in workload)):
        running = [p + step for p, n in workload if n > step]
        reads = facts["decode_weight_bytes"] + facts["kv_bytes_per_token"] * sum(running)
        flops = 2 * facts["matmul_params"] * len(running) + sum(attention_flops(facts, 1, c) for c in running)
        t += max(reads / bw, flops / rate)
    return sum(n for _, n in workload) / t


def serving_pids(pid: int) -> dict[str, int]:
    """The processes to sample: the server's ("server"; with --api-server-count, its first server
    process "api0" instead of the launcher) and, with --engine-process, its engine process."""
    kids = spawned(pid)
    out = {"server": kids["api0"]} if "api0" in kids else {"server": pid}
    if "engine" in kids:
        out["engine"] = kids["engine"]
    return out


def spy_on(pids: dict[str, int], seconds: int, out_dir: str | None, tag: str) -> list:
    """py-spy recording each of `pids` for `seconds` (raw stacks into `out_dir`), when py-spy is
    here (`gpu_wheels.sh` brings it: /tmp/site/bin) and may attach; [] otherwise."""
    here = [os.path.join(os.path.dirname(sys.executable), "py-spy"), "/tmp/site/bin/py-spy"]
    exe = shutil.which("py-spy") or next((p for p in here if os.path.exists(p)), None)
    if exe is None:
        return []
    out_dir = SPY_DIR  # (not $OUT: at most 8 files come back from it; the log holds their summary)
    os.makedirs(out_dir, exist_ok=True)
    spies = []
    for name, pid in pids.items():
        path = os.path.join(out_dir, f"spy{tag}-{name}.txt")
        cmd = [exe, "record", "-p", str(pid), "-d", str(seconds), "-r", "200", "-f", "raw", "-o", path, "--nonblocking",
               "--gil"]
        spies.append((name, path, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
    return spies


def spy_results(spies: list, top: int = 12) -> dict[str, dict[str, list[tuple[str, float]]]]:
    """Each recording's samples (taken while the process held the GIL: its Python's work) as two
    top-`top` lists of (place, share): ``files``, the file of each sample's innermost frame (where
    the time went: ours or a library's), and ``ours``, nextoken's functions counted for every
    sample they are on the stack of (inclusive), less those on nearly all (the loops around)."""
    out = {}
    for name, path, p in spies:
        files: dict[str, int] = {}
        ours: dict[str, int] = {}
        total = 0
        try:
            p.wait(timeout=30)
            with open(path) as f:
                for line in f:
                    stack, _, n = line.rstrip().rpartition(" ")
                    if not stack:
                        continue
                    frames, n = stack.split(";"), int(n)
                    total += n
                    leaf = frames[-1].rsplit("(", 1)[-1].rsplit(":", 1)[0]
                    files[leaf] = files.get(leaf, 0) + n
                    for fn in {fr.rsplit(":", 1)[0] + ")" for fr in frames if "nextoken/" in fr}:
                        ours[fn] = ours.get(fn, 0) + n
        except (OSError, ValueError, subprocess.TimeoutExpired):
            p.kill()
            continue
        if not total:
            continue
        rank = lambda d, cut=1.0: [(k, v / total) for k, v in sorted(d.items(), key=lambda kv: -kv[1])  # noqa: E731
                                   if v / total <= cut][:top]
        out[name] = {"files": rank(files), "ours": rank(ours, 0.9)}
    return out


def process_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user and system, all threads) of process `pid` ("server") and of each process
    it started with `multiprocessing` (`spawned`: "engine", "api0", ...), from /proc; {} where
    /proc is not readable."""
    tick = os.sysconf("SC_CLK_TCK")

    def seconds(p: int) -> float:
        with open(f"/proc/{p}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    try:
        return {"server": seconds(pid), **{name: seconds(p) for name, p in spawned(pid).items()}}
    except OSError:
        return {}


def engine_metrics(url: str) -> dict[str, float]:
    """The server's step-time histogram's sum and count and, under async scheduling, its wait for
    the device, from its Prometheus text (``/metrics``); {} when it cannot be read."""
    import httpx

    wanted = ("nextoken_step_duration_seconds_sum", "nextoken_step_duration_seconds_count",
              "nextoken_device_wait_seconds_total")
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            out[name] = float(value)
    return out


def server_smoke(url: str, model: str, vocab: int) -> dict:
    """The APIs on the GPU engine, each call's status (and what it must hold): a chat completion,
    JSON held to a schema (the grammar's mask on device logits), completions with log-probabilities
    from token ids, a beam search, Anthropic's Messages, and the inspector's journey (a traced
    request: the reference attention and the per-layer views) and views (with the engine in a
    process of its own, the inspector it serves there, through the server)."""
    import httpx

    schema = {"type": "object", "properties": {"a": {"enum": [1, 2, 3]}}, "required": ["a"],
              "additionalProperties": False}
    calls = {
        "chat": ("/v1/chat/completions", {"model": model, "max_tokens": 16,
                                          "messages": [{"role": "user", "content": "Hello there"}]}),
        "json_schema": ("/v1/chat/completions", {"model": model, "max_tokens": 40, "messages": [
            {"role": "user", "content": "A JSON object"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
        "completions_logprobs": ("/v1/completions", {"model": model, "prompt": list(range(10, 40)), "max_tokens": 8,
                                                     "logprobs": 2, "temperature": 0.7, "seed": 1}),
        "messages": ("/v1/messages", {"model": model, "max_tokens": 8,
                                      "messages": [{"role": "user", "content": "Hi"}]}),
        "beam_search": ("/v1/completions", {"model": model, "prompt": "The best", "max_tokens": 4,
                                            "use_beam_search": True, "best_of": 3, "n": 2}),
        "journey": ("/inspect/api/journey/step", {"prompt": "The capital of France is", "generated": []}),
        "sample": ("/inspect/api/sample", {"prompt": "Hello", "seed": 3, "temperature": 0.8, "top_p": 0.9}),
        "sample_regex": ("/inspect/api/sample", {"prompt": "Hello", "regex": "[a-c]+"}),
        "trace": ("/inspect/api/trace", {"prompt": "The animal didn't cross the street"}),
        "kv_contrast": ("/inspect/api/kv/contrast", {"prompt": "Hello there", "tokens": 4}),
        "beam": ("/inspect/api/beam", {"prompt": "The best thing about", "beam_width": 3, "max_tokens": 4}),
        "spec_run": ("/inspect/api/spec/run", {"prompt": "a b c a b c a b", "max_tokens": 8}),
        "quant_kl": ("/inspect/api/quant/kl", {"prompt": "Hello world, a test."}),
        "analogy": ("/inspect/api/analogy", {"a": "a", "b": "b", "c": "c", "target": "d"}),
        "rope": ("/inspect/api/rope", None),
        "architecture": ("/inspect/api/architecture", None),
        "state": ("/inspect/api/state", None),
    }
    out = {}
    for name, (path, body) in calls.items():
        try:
            r = httpx.post(url + path, json=body, timeout=120) if body is not None else httpx.get(url + path, timeout=60)
            if name == "trace" and r.status_code == 200:  # its views too: attention, the logit lens
                tid = r.json()["trace_id"]
                for view, params in (("attention", {"layer": 1}), ("lens", {"position": 2}), ("lens_grid", {})):
                    v = httpx.get(f"{url}/inspect/api/trace/{tid}/{view}", params=params, timeout=60)
                    out[f"trace_{view}"] = str(v.status_code) + ("" if v.status_code == 200 else " " + v.text[:200])
            note = str(r.status_code)
            if name == "json_schema" and r.status_code == 200:
                text = r.json()["choices"][0]["message"]["content"]
                note += " valid" if isinstance(json.loads(text).get("a"), int) else f" INVALID {text!r}"
            elif r.status_code != 200:
                note += " " + r.text[:200]
        except Exception as exc:  # noqa: BLE001 - each call reported on its own
            note = f"{type(exc).__name__}: {exc}"
        out[name] = note
    return out


def transformers_generate(folder: str, vocab: int) -> dict:
    """`transformers`' greedy `generate` (bf16, SDPA) on 512-token prompts, 128 new tokens, at
    batch 128, 256 and 512: output tokens/s of each, and the best. (On the H200 a step took about
    80 ms at both 32 and 128 rows, its Python's pace: its best batch is a large one.)"""
    import torch

    hf = hf_model(folder, torch.bfloat16)
    rng = random.Random(5)
    out = {}
    new = 128 if DEV == "cuda" else 8
    for b in DRY["hf_batches"]:
        ids = torch.tensor([rand_ids(rng, DRY["prompt"], vocab) for _ in range(b)], device=DEV)
        with torch.no_grad():
            hf.generate(ids[:, :16], attention_mask=torch.ones_like(ids[:, :16]), max_new_tokens=4, do_sample=False,
                        pad_token_id=vocab - 3)
            sync()
            t0 = time.perf_counter()
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=vocab - 3)
            sync()
        out[f"hf_b{b}_tok_s"] = b * new / (time.perf_counter() - t0)
        log(f"   transformers generate, batch {b}: {out[f'hf_b{b}_tok_s']:.0f} output tok/s")
    out["hf_best_tok_s"] = max(out.values())
    del hf
    return out


# -- the table ------------------------------------------------------------------------------------------
def fmt(x, spec=".0f", suffix="") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    return f"{x:{spec}}{suffix}"


def async_share(r: dict) -> str:
    """The async batch-1 rate's share of the roofline, as the table shows it (the GPU's default)."""
    if r.get("b1_async_greedy_tok_s") and r.get("b1_roofline_tok_s"):
        return f" ({100 * r['b1_async_greedy_tok_s'] / r['b1_roofline_tok_s']:.1f}%)"
    return ""


def async_ratio(r: dict) -> str:
    """The async 64-sequence step over its roofline step, as the table shows it."""
    if r.get("b64_async_greedy_step_ms") and r.get("b64_roofline_ms"):
        return f" ({r['b64_async_greedy_step_ms'] / r['b64_roofline_ms']:.1f}x)"
    return ""


def table(limits: dict) -> str:
    lines = [f"GPU check, {time.strftime('%Y-%m-%d')}: {limits.get('name', '?')}, copy "
             f"{limits.get('bandwidth', 0) / 1e12:.2f} TB/s, bf16 {limits.get('bf16_rate', 0) / 1e12:.0f} TFLOP/s; "
             f"torch {limits.get('torch')}, triton {limits.get('triton')}",
             "", "| model | batch-1 decode tok/s greedy / sampled (roofline, share) | 64x(512+256) decode step ms "
             "greedy / sampled (roofline, ratio) | async scheduling: batch-1 tok/s (share), 64x step ms greedy (ratio) | prefill 4096 "
             "ms (share of bf16 rate) | serving out tok/s (transformers best, ratio; roofline, share) | f32 rel err prefill / decode | bf16 first 16 equal, in top-5 /32, mean logprob err vs f32 ours / transformers' bf16 | "
             "batch-invariant f32 / bf16 / bf16 --batch-invariant (its time) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in RESULTS["models"].items():
        ratio = r["serve_out_tok_s"] / r["hf_best_tok_s"] if r.get("serve_out_tok_s") and r.get("hf_best_tok_s") \
            else None
        b1 = 100 * r["b1_share"] if "b1_share" in r else None
        pre = 100 * r["prefill4096_share"] if "prefill4096_share" in r else None
        lines.append(
            f"| {name} | {fmt(r.get('b1_greedy_tok_s'))} / {fmt(r.get('b1_sampled_tok_s'))} "
            f"({fmt(r.get('b1_roofline_tok_s'))}, {fmt(b1, '.0f', '%')}) | "
            f"{fmt(r.get('b64_greedy_step_ms'), '.2f')} / {fmt(r.get('b64_sampled_step_ms'), '.2f')} "
            f"({fmt(r.get('b64_roofline_ms'), '.2f')}, {fmt(r.get('b64_ratio'), '.1f', 'x')}) | "
            f"{fmt(r.get('b1_async_greedy_tok_s'))}{async_share(r)}, {fmt(r.get('b64_async_greedy_step_ms'), '.2f')}"
            f"{async_ratio(r)} | "
            f"{fmt(r.get('prefill4096_ms'), '.1f')} ({fmt(pre, '.0f', '%')}) | "
            f"{fmt(r.get('serve_out_tok_s'))}{' async' if r.get('serve_async_scheduling') else ''}"
            f"{' proc' if r.get('serve_engine_process') else ''}"
            f"{' x' + str(r['serve_api_servers']) if (r.get('serve_api_servers') or 1) > 1 else ''} "
            f"({fmt(r.get('hf_best_tok_s'))}, {fmt(ratio, '.1f', 'x')}"
            f"{'; roofline %.0f, %.0f%%' % (r['serve_roofline_tok_s'], 100 * r['serve_out_tok_s'] / r['serve_roofline_tok_s']) if r.get('serve_roofline_tok_s') else ''})"
            f"{'; one process ' + fmt(r['serve_oneproc_out_tok_s']) if 'serve_oneproc_out_tok_s' in r else ''} | "
            f"{fmt(r.get('f32_prefill_rel'), '.1e')} / {fmt(r.get('f32_decode_rel'), '.1e')} | "
            f"{fmt(r.get('bf16_first16_equal'))}, {fmt(r.get('bf16_in_top5'))}"
            f"{', lp err %.3f / %.3f' % (r['bf16_lp_err']['ours'][0], r['bf16_lp_err']['transformers'][0]) if 'bf16_lp_err' in r else ''} | "
            f"{fmt(r.get('f32_batch_invariant'))} / {fmt(r.get('bf16_batch_invariant'))} / "
            f"{fmt(r.get('bf16_invariant_mode'))} ({fmt(r.get('bf16_invariant_time'), '.2f', 'x')}) |")
    lines.append("")
    lines += [f"{k}: {v}" for k, v in RESULTS["sections"].items()]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(ORDER), help=f"comma-separated, of {', '.join(ORDER)}")
    ap.add_argument("--skip", default="", help="comma-separated sections to skip: tests, exact, speed, serve, hf (transformers' generate)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds; later sections are skipped past it (default 460; a dry run: no limit, every "
                         "section runs)")
    ap.add_argument("--tests-timeout", type=float, default=0,
                    help="seconds for the GPU tests (0: a third of the budget, 60 to 170)")
    ap.add_argument("--folders", default="/tmp/nextoken-gpu-models", help="where the model folders are written")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: tiny models on the CPU, to check this script")
    ap.add_argument("--stream-interval", type=int, default=1, help="the server's --stream-interval in the serving section")
    ap.add_argument("--serve-async", choices=("auto", "on", "off"), default="auto",
                    help="the server's --async-scheduling: auto, on when the speed section's async runs went through")
    ap.add_argument("--serve-process", choices=("both", "on", "off"), default="both",
                    help="the server's --engine-process: on, off, or both (on first, then off as time allows)")
    ap.add_argument("--api-servers", type=int, default=0,
                    help="the server's --api-server-count with --engine-process (0: 4 on a GPU machine, 2 in a dry run)")
    args = ap.parse_args()
    import torch

    global DEV
    skip = set(filter(None, args.skip.split(",")))
    out_dir = os.environ.get("OUT")
    limits: dict = {}
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        DEV = "cpu"
        from nextoken.runner import plan as plan_module  # the GPU plan's row-wise kernels, fused matmuls, GEMMs, draw

        choose = plan_module.ExecutionPlan.choose.__func__
        plan_module.ExecutionPlan.choose = classmethod(
            lambda cls, *a, **k: plan_module.replace(p := choose(cls, *a, **k), rowwise=p.attention == "triton",
                                                     fused=p.attention == "triton", gemv=p.attention == "triton",
                                                     skinny=p.attention == "triton",
                                                     triton_sampling=p.attention == "triton"))
        DRY.update(others=2, speed_tokens=6, batch=3, prompt=20, prefill=64, requests=6, hf_batches=(2,), b1_prompt=16,
                   reps=1)
        args.budget = float("inf") if args.budget is None else args.budget
        args.models = "tiny-llama,tiny-gemma3" if args.models == ",".join(ORDER) else args.models
        limits = {"name": "CPU (dry run)", "bandwidth": 1e10, "bf16_rate": 1e11}
        skip.add("tests")
    elif not torch.cuda.is_available():
        print("no GPU visible to PyTorch: this check runs on a GPU machine (or --dry-run)", file=sys.stderr)
        return 2
    else:
        args.budget = 460.0 if args.budget is None else args.budget
        with section("card", args.budget) as go:
            if go:
                limits = card()
                RESULTS["card"] = limits
    from gpu_models import MODELS, TINY, build_folder

    models = [m for m in args.models.split(",") if m]
    for name in models:
        r = RESULTS["models"].setdefault(name, {})
        vocab = {**MODELS, **TINY}[name][1]["vocab_size"]
        folder = os.path.join(args.folders, name)
        with section(f"{name}: folder", args.budget, 20) as go:
            if not go:
                continue
            build_folder(name, folder, DEV)
        if "exact" not in skip:
            with section(f"{name}: float32 exactness", args.budget, 30) as go:
                if go:
                    r.update(exact_float32(folder, vocab))
                    log(f"   float32 relative error: prefill {r['f32_prefill_rel']:.1e}, decode "
                        f"{r['f32_decode_rel']:.1e}")
            with section(f"{name}: bf16 exactness and batch invariance", args.budget, 30) as go:
                if go:
                    r.update(exact_bf16(folder, vocab))
                    log(f"   bf16: first 16 equal {r['bf16_first16_equal']} (agree for {r['bf16_agree_prefix']}), "
                        f"{r['bf16_in_top5']}/32 in the top 5; batch-invariant f32 {r['f32_batch_invariant']}, bf16 "
                        f"{r['bf16_batch_invariant']}")
        if "speed" not in skip and limits:
            with section(f"{name}: speed", args.budget, 45) as go:
                if go:
                    r.update(speed(folder, vocab, limits, profile_to=os.path.join(out_dir or "/tmp", "profile.txt")
                                   if name == models[0] else None))
        if "serve" not in skip and name == models[0]:
            overlap = args.serve_async == "on" or (args.serve_async == "auto" and "b64_async_greedy_out_tok_s" in r)
            with section(f"{name}: serving", args.budget, 60) as go:
                if go:
                    r.update(serving(folder, vocab, out_dir, DRY["requests"], args.stream_interval, overlap,
                                     args.serve_process != "off", args.api_servers or (2 if args.dry_run else 4)))
                    if "decode_weight_bytes" in r and r.get("serve_workload") and limits:  # (the speed rows' facts)
                        r["serve_roofline_tok_s"] = serving_roofline(r["serve_workload"], r, limits)
                        log(f"   serving's roofline on this card (every request's prefill at the bf16 rate, then "
                            f"each decode step at the bandwidth): {r['serve_roofline_tok_s']:.0f} output tok/s; "
                            f"measured {r['serve_out_tok_s'] / r['serve_roofline_tok_s']:.0%} of it")
            with section(f"{name}: transformers generate", args.budget, 25) as go:
                if go and "hf" not in skip:
                    r.update(transformers_generate(folder, vocab))
        if "tests" not in skip and name == models[0]:  # after the first model's table rows, which matter most
            with section("tests", args.budget, 60) as go:
                if go:
                    RESULTS["tests"] = gpu_tests(timeout=args.tests_timeout or max(60.0, min(170.0, args.budget / 3)))
                    log("   tests:", RESULTS["tests"]["summary"])
        if out_dir:
            with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
                json.dump(RESULTS, f, indent=1, default=str)
    first = RESULTS["models"].get(models[0], {}) if models else {}
    if "serve" not in skip and args.serve_process == "both" and models:  # the other way, with the time left
        with section(f"{models[0]}: serving in one process", args.budget, 60) as go:
            if go:
                vocab = {**MODELS, **TINY}[models[0]][1]["vocab_size"]
                overlap = args.serve_async == "on" or (args.serve_async == "auto"
                                                       and "b64_async_greedy_out_tok_s" in first)
                one = serving(os.path.join(args.folders, models[0]), vocab, out_dir, DRY["requests"],
                              args.stream_interval, overlap, False)
                first.update({k.replace("serve_", "serve_oneproc_", 1): v for k, v in one.items()})
    if "bf16_tokens" in first:  # last, with the time left: the first model's bf16 under --batch-invariant
        with section(f"{models[0]}: bf16 --batch-invariant", args.budget, 30) as go:
            if go:
                vocab = {**MODELS, **TINY}[models[0]][1]["vocab_size"]
                first.update(invariant_mode(os.path.join(args.folders, models[0]), vocab, first))
    print("\n" + table(limits), flush=True)
    if out_dir:
        with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
        with open(os.path.join(out_dir, "table.md"), "w") as f:
            f.write(table(limits) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
