"""Which Triton compilations a serving-like load would start after the engine is warm, found on
a machine without a GPU.

A kernel compiles once per specialization: its constexprs, and for each argument not marked
``do_not_specialize`` whether an integer is 1 or a multiple of 16 and a pointer 16-byte aligned.
On a GPU, one met after the warm-up compiles while users wait (`kernels.gpu.compiles` logs it;
the H200's serving run of 2026-11-30 spent a tenth of its engine's samples in the compiler).
Here the GPU plan's kernels run under Triton's interpreter, on the CPU, and every launch is keyed
as Triton's own binder keys it for sm_90 (`create_function_from_signature` with the CUDA
backend): the keys met at load (a pass of `max_num_batched_tokens` tokens, as the GPU's memory
profiling runs; the decode graphs' batch sizes; the draw's timing at load), then in
`launch.warm_up`, then under a load of mixed prompts (1 to 100 tokens, greedy and sampled, top-p
and top-k, a cached prefix, prefill chunks beside decodes). Prints the keys the load met first
and how each differs from the nearest key met before.

    python benchmarks/triton_specializations.py [--prompts 10]

The model is a random-weight bf16 folder of the tiny Llama config (`gpu_models.build_folder`);
about two minutes on two cores. The GPU's own load compiles more than this one (its timings at
load, decode graphs up to 256 or 1024 rows), so a key new here may be met at load there.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import random
import sys
import tempfile
import time

os.environ["TRITON_INTERPRET"] = "1"
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]


def recorder():
    """Patch the interpreter's launches to record each one's sm_90 key: returns (``{key:
    phase}`` in first-met order, the one-element list holding the current phase's name)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 64))
    binders: dict = {}
    seen: dict = collections.OrderedDict()
    phase = ["load"]
    run = interpreter.InterpretedFunction.run

    def key_of(fn, args, kwargs):
        if fn.fn not in binders:
            kw = {k: v for k, v in fn.kwargs.items() if k in ("do_not_specialize", "do_not_specialize_on_alignment")}
            jit = JITFunction(fn.fn, **kw)
            binders[fn.fn] = (list(jit.signature.parameters), create_function_from_signature(jit.signature,
                                                                                           jit.params, backend))
        names, binder = binders[fn.fn]
        _, spec, options = binder(*args, **kwargs)
        return fn.fn.__name__, tuple((n, s[0], s[1]) for n, s in zip(names, spec)), tuple(sorted(options.items()))

    def recording(self, *args, grid, warmup, **kwargs):
        seen.setdefault(key_of(self, args, kwargs), phase[0])
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recording
    return seen, phase


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=10)
    args = ap.parse_args()
    seen, phase = recorder()
    import torch

    from gpu_models import build_folder
    from nextoken import LLM, SamplingParams
    from nextoken.engine.launch import warm_up
    from nextoken.kernels.gpu.sampling import TIMED_ROWS, draw_rows
    from nextoken.runner import plan as plan_module
    from nextoken.runner.model_runner import SequenceInput

    choose = plan_module.ExecutionPlan.choose.__func__

    def gpu_plan(cls, *a, **k):  # (what a GPU's plan turns on, here on the CPU)
        return dataclasses.replace(choose(cls, *a, **k), rowwise=True, fused=True, gemv=True, skinny=True,
                                   cuda_graphs=True, triton_sampling=True)

    plan_module.ExecutionPlan.choose = classmethod(gpu_plan)
    folder = build_folder("tiny-llama", os.path.join(tempfile.mkdtemp(), "tiny-llama"), "cpu")
    batched = 128
    llm = LLM(folder, dtype="bfloat16", enforce_eager=True, attention_backend="triton", max_num_seqs=8,
              block_size=16, num_kv_blocks=256, max_num_batched_tokens=batched, max_model_len=256)
    runner = llm.engine.runner
    vocab = runner.config.vocab_size
    with torch.inference_mode():  # (the GPU's memory profiling pass, and its timing of the draw)
        runner.execute([SequenceInput([0] * batched, 0, list(range(batched // 16)))])
        for b in TIMED_ROWS[:3]:
            draw_rows(torch.randn(b, vocab), torch.full((b,), 0.8), torch.zeros(b, dtype=torch.int32),
                      torch.full((b,), 0.95), torch.zeros(b), torch.rand(b))
    phase[0] = "warm-up"
    warm_up(llm.engine)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab - 3) for _ in range(rng.randint(1, 100))] for _ in range(args.prompts)]
    prompts.append(prompts[0][:40] + [5, 6, 7])  # (a cached prefix)
    params = [SamplingParams(temperature=rng.choice([0, 0.8]), top_p=rng.choice([1.0, 0.9]),
                             top_k=rng.choice([0, 20]), seed=i, max_tokens=rng.randint(1, 12), ignore_eos=True)
              for i in range(len(prompts))]
    phase[0] = "serving"
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    print(f"the load: {len(prompts)} prompts in {time.perf_counter() - t0:.0f} s")
    print("keys met first:", dict(collections.Counter(seen.values())))
    for (name, spec, options), met in seen.items():
        if met != "serving":
            continue
        earlier = [s for (n, s, _), m in seen.items() if n == name and m != "serving"]
        if not earlier:
            print(f"  {name}: a kernel first met under the load")
            continue
        near = min(earlier, key=lambda s: sum(a != b for a, b in zip(s, spec)))
        diff = {a[0]: (b[1:], a[1:]) for a, b in zip(spec, near) if a != b}
        print(f"  {name} {dict(o for o in options if o[0] in ('num_warps', 'num_stages'))}: (before, now) {diff}")


if __name__ == "__main__":
    main()
