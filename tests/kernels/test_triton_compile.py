"""Our Triton kernels compiled for Hopper (sm_90) without a GPU: every variant of the attention
the catalog's models run, the batch-invariant matmul and RMSNorm, the row-wise kernels, the
GEMV, the split-K GEMM and the sampler's draw, compiles, spills nothing to local memory, and (bf16 products) multiplies on the tensor cores.
The tiles (`kernels.gpu.attention.tiling`) were chosen from this report, under the Triton of the
tests (3.9) and of the GPU machine (3.6, whose register allocation differs); a change that makes
a variant spill or fail to compile fails here, before any GPU time is spent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is a test dependency (pyproject's test extra)")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reports():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.triton_report"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_every_variant_compiles_without_spills(reports):
    from tests.helpers.triton_report import GEMV, INVARIANT, ROWWISE, SAMPLING, SKINNY, VARIANTS

    assert [r["variant"] for r in reports] == [list(v) for v in VARIANTS] + [list(v) + [0] * (3 - len(v))
                                                                           for v in INVARIANT] + [
        list(v) for v in ROWWISE] + [list(v) for v in GEMV] + [list(v) for v in SKINNY] + [
        list(v) for v in SAMPLING]
    for r in reports:
        assert r["stack"] == 0 and r["local"] == 0, r  # (a spill needs a stack frame)
        assert r["registers"] <= 255, r
        if r["variant"][0] == "bf16" or r["variant"][:2] in (["linear", "bf16"], ["skinny", "bf16"]):
            assert r["tensor_core"] > 0, r
        if r["variant"][0] in ("gemv", "draw"):  # the weight rows, the logits stream in 16-byte loads
            assert r["wide_loads"] > 0, r
