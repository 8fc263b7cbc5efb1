"""Our Triton kernels compiled for Hopper (sm_90) without a GPU: every variant of the attention
the catalog's models run, the batch-invariant matmul and RMSNorm, the row-wise kernels, the
GEMV, the split-K GEMM and the sampler's draw, compiles, spills nothing to local memory, and (bf16 products) multiplies on the tensor cores.
The tiles (`kernels.gpu.attention.tilings`) and launches the plan may time were chosen from this
report, under the Triton of the tests (3.9) and of the GPU machine (3.6, whose register
allocation differs), each compiled as a launch specializes on the model's aligned tensors; a
change that makes a variant spill or fail to compile fails here, before any GPU time is spent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is a test dependency (pyproject's test extra)")
ROOT = Path(__file__).resolve().parents[2]


def run_report(*args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.triton_report", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def reports():
    return run_report()


JOINED_NORMS = ("gemv norm", "gemv norm silu", "gemv norm gemma")  # (the add and norm after the GEMV, in its launch)
ROUNDED_STEP_BY_STEP = ("act", "rope", "rope store", "add_norm", "add_norm gemma", "rms_norm", "gemv rope",
                        *JOINED_NORMS)


def check(r: dict) -> None:
    """No spill; tensor cores for bf16 products; 16-byte loads where a kernel streams its input;
    no fused multiply-add in the kernels that repeat PyTorch's roundings (`batch_invariant.NO_FMA`:
    compiled with Triton's default contraction, RoPE's and Gemma's residual add lost a rounding on
    the H200, where the interpreter's tests cannot see it)."""
    assert r["stack"] == 0 and r["local"] == 0, r  # (a spill needs a stack frame)
    assert r["registers"] <= 255, r
    if r["variant"][0] == "bf16" or r["variant"][:2] in (["linear", "bf16"], ["skinny", "bf16"]):
        assert r["tensor_core"] > 0, r
    if r["variant"][0] in ROUNDED_STEP_BY_STEP:
        assert r["fma"] == 0, r
    if r["variant"][0] in ("gemv", "gemv silu", "gemv rope", "draw", "draw cached", *JOINED_NORMS):  # the weight
        assert r["wide_loads"] > 0, r  # rows, the logits stream in 16-byte loads
    if (r["variant"][0] in ("bf16", "fp32") and r["variant"][3] and r["variant"][4] > 1) \
            or r["variant"][0] in JOINED_NORMS:  # split decodes, and the GEMV's add and norm: the last program
        # joins them after its ticket's acquire-release atomic, reading the others' outputs from L2
        assert r["acq_rel_atomics"] == 1 and r["l2_loads"] > 0, r


@pytest.mark.slow
def test_every_launch_the_plan_times_compiles_without_spills():
    """The other attention tiles, GEMV and split-K GEMM launches the plan times at load
    (`attention.tilings`, `gemv.LAUNCHES`, `skinny.LAUNCHES`) compile as cleanly: a timed choice
    never picks a spilling launch. (Slow: about 40 more compilations on a cold Triton cache; a
    launch that spilled or did not build would only lose its timing or drop out of it.)"""
    from tests.helpers.triton_report import GEMV_LAUNCHES, SKINNY_LAUNCHES, TILES

    reports = run_report("--launches")
    assert [r["variant"] for r in reports] == [list(v) for v in TILES + GEMV_LAUNCHES + SKINNY_LAUNCHES]
    for r in reports:
        check(r)


def test_every_variant_compiles_without_spills(reports):
    from tests.helpers.triton_report import GEMV, INVARIANT, ROWWISE, SAMPLING, SKINNY, VARIANTS

    assert [r["variant"] for r in reports] == [list(v) for v in VARIANTS] + [list(v) + [0] * (3 - len(v))
                                                                           for v in INVARIANT] + [
        list(v) for v in ROWWISE] + [list(v) for v in GEMV] + [list(v) for v in SKINNY] + [
        list(v) for v in SAMPLING]
    for r in reports:
        check(r)
