"""The execution plan (`nextoken.runner.plan`): chosen once at load, logged in one line, and the
only thing that decides which kernels run."""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import sys

import pytest
import torch

from nextoken.layers.quantization.methods import CodesMethod, DenseMethod, TorchInt4Method
from nextoken.loader.gguf import GGUFFile
from nextoken.runner.model_runner import ModelRunner
from tests.tiny_models import OneSequence, tiny_hf_model, write_gguf

QUANT = {"attn_q.weight": "Q4_0", "attn_k.weight": "Q4_1", "attn_v.weight": "Q8_0", "attn_output.weight": "Q5_0",
         "ffn_gate.weight": "Q5_1", "ffn_up.weight": "Q8_0", "ffn_down.weight": "Q4_0"}
PROMPT = [5, 17, 200, 33, 41, 270, 90, 12]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "q.gguf"
    write_gguf(tiny_hf_model("llama", seed=4), path, "llama", quant=QUANT)
    return path


def methods(runner) -> set[type]:
    layer = runner.model.layers[0]
    return {type(lin.method) for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.mlp.up_proj)}


def test_default_bf16_plan_uses_our_kernels(quantized):
    runner = ModelRunner(GGUFFile(quantized), torch.bfloat16)
    assert runner.plan.codes and runner.plan.attention == "native" and runner.plan.native_decode
    assert methods(runner) == {CodesMethod}
    assert runner.native_decoder is not None
    lib = runner.plan.kernels.activation
    assert runner.plan.native_activations and all(layer.mlp.act_kernel is lib for layer in runner.model.layers)
    assert all(layer.norm_kernel is lib for layer in runner.model.layers) and runner.model.norm_kernel is lib
    assert runner.model.embed_tokens.lookup_kernel is runner.plan.kernels.qmatmul  # (used where it holds codes)


def test_enforce_eager_plan_is_pytorch_alone(quantized, monkeypatch):
    """Fixed at load: afterwards no C kernel is even looked up, prefill or decode."""
    runner = ModelRunner(GGUFFile(quantized), torch.bfloat16, enforce_eager=True)
    assert not runner.plan.codes and runner.plan.attention == "torch" and not runner.plan.native_decode
    assert TorchInt4Method in methods(runner) and CodesMethod not in methods(runner)  # (small k: dense)
    assert runner.native_decoder is None
    assert not runner.plan.native_activations and not any(layer.mlp.act_kernel for layer in runner.model.layers)
    assert not any(layer.norm_kernel for layer in runner.model.layers) and runner.model.norm_kernel is None
    assert runner.model.embed_tokens.lookup_kernel is None
    forbid_kernel_lookups(monkeypatch)
    seq = OneSequence(runner)
    logits = seq.forward(PROMPT)
    seq.forward([int(logits.argmax())])  # a decode step too


def forbid_kernel_lookups(monkeypatch) -> None:
    """From here on, looking a kernel up or reading NEXTOKEN_NATIVE_KERNELS fails the test."""
    def no_lookup(*args, **kwargs):
        raise AssertionError("a kernel was looked up, or the environment read, while the model ran")

    monkeypatch.setattr("nextoken.kernels.native_allowed", no_lookup)
    monkeypatch.setattr("nextoken.kernels.load", no_lookup)  # (the layers import no `load`: they are handed one)


def test_the_default_plan_binds(quantized, monkeypatch):
    """With our kernels, the model runs on the handles the plan resolved at load: prefill, the
    one-call decode and the PyTorch layers' decode (native attention, codes, activations) never
    look a kernel up nor read the environment, and nothing falls back."""
    from nextoken import kernels

    runner = ModelRunner(GGUFFile(quantized), torch.bfloat16)
    before = sum(kernels.fallbacks.values())
    forbid_kernel_lookups(monkeypatch)
    seq = OneSequence(runner)
    logits = seq.forward(PROMPT)
    seq.forward([int(logits.argmax())])  # the one-call C decode step
    runner.native_decoder = None
    seq.forward([int(logits.argmax())])  # the PyTorch layers on the plan's kernels
    assert sum(kernels.fallbacks.values()) == before


def test_a_kernel_method_without_its_library_is_a_load_error():
    """The plan binds with no back door: a method that runs on our kernel refuses to exist
    without the library the plan resolved (never a lookup at run time)."""
    from nextoken.errors import ModelLoadError
    from nextoken.kernels import KernelSet
    from nextoken.runner.plan import ExecutionPlan

    plan = ExecutionPlan(torch.bfloat16, codes=True, torch_int4=False, dense_weights=False, attention="native",
                         kernels=KernelSet())
    with pytest.raises(ModelLoadError, match="without its kernel library"):
        plan.linear_method("Q4_0", 64, 64)


def test_a_refused_call_is_counted(quantized):
    """A call the plan's kernel cannot take (here float16 activations into a codes matmul) runs
    PyTorch and is counted by kernel, in the process and in the running engine's own counts
    (`KernelSet.fallbacks`, which `LLMEngine.scheduler_stats` and /metrics report)."""
    from nextoken import kernels

    runner = ModelRunner(GGUFFile(quantized), torch.bfloat16)
    lin = runner.model.layers[0].self_attn.q_proj
    before = kernels.fallbacks["codes matmul on torch.float16"]
    x = torch.randn(3, lin.in_features)
    y = lin(x.half())
    assert y.shape == (3, lin.out_features) and torch.isfinite(y).all()
    assert kernels.fallbacks["codes matmul on torch.float16"] == before + 1
    # each engine counts its own: the call inside this runner's pass goes to its plan's counts only
    other = ModelRunner(GGUFFile(quantized), torch.bfloat16)
    with kernels.counting(runner.plan.kernels.fallbacks):
        lin(x.half())
    assert runner.plan.kernels.fallbacks.snapshot() == {"codes matmul on torch.float16": 1}
    assert other.plan.kernels.fallbacks.snapshot() == {}


def test_float32_and_reference_plans(quantized):
    runner = ModelRunner(GGUFFile(quantized), torch.float32, reference=True)
    assert methods(runner) == {DenseMethod} and runner.plan.attention == "reference"
    assert not runner.plan.native_decode and runner.model.embed_tokens.weight is not None


def test_keep_quantized_off_is_dense(quantized):
    runner = ModelRunner(GGUFFile(quantized), torch.bfloat16, keep_quantized=False)
    assert methods(runner) == {DenseMethod}


def test_the_plans_agree(quantized):
    """The same model under each plan: the quantized plans stay close to the dense float32 one."""
    f32 = OneSequence(ModelRunner(GGUFFile(quantized), torch.float32, reference=True)).forward(PROMPT)
    for kwargs in ({}, {"enforce_eager": True}):
        b16 = OneSequence(ModelRunner(GGUFFile(quantized), torch.bfloat16, **kwargs)).forward(PROMPT)
        assert (f32.softmax(-1) - b16.softmax(-1)).abs().max() < 0.02, kwargs


def test_the_plan_is_logged_once(quantized, caplog):
    with caplog.at_level(logging.INFO, logger="nextoken"):
        ModelRunner(GGUFFile(quantized), torch.bfloat16, enforce_eager=True)
    lines = [r.getMessage() for r in caplog.records if "execution plan" in r.getMessage()]
    assert len(lines) == 1
    assert "torch-int4" in lines[0] and "attention: torch" in lines[0] and "enforce_eager" in lines[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tied and untied heads
def test_the_head_never_expands_its_int4_weight(tiny_gguf, arch):
    """The LM head's calls have one row per sequence: on the int4 path it always runs the int4
    kernel (a batch of 64 sequences must not expand the head's weight every step)."""
    runner = ModelRunner(GGUFFile(tiny_gguf[arch][0]), torch.bfloat16, enforce_eager=True)
    assert runner.model.lm_head.few_rows


def test_run_time_malloc_settings_are_taken(caplog):
    """After a load, each mallopt setting is taken (glibc answers 0 for a value it refuses), and a
    32 MiB buffer freed and allocated again reuses the heap's pages: without the trim threshold
    glibc handed the freed top of the heap back to the OS on every free, and every step's
    activations were faulted in again."""
    from nextoken.loader.host_memory import libc, loading_allocations, scratch_allocations

    if libc() is None:
        pytest.skip("not glibc: nextoken does not tune malloc here")
    with caplog.at_level(logging.DEBUG, logger="nextoken.runner"):
        loading_allocations(True)
        with scratch_allocations():
            pass
        loading_allocations(False)
    assert not [r for r in caplog.records if "refused" in r.getMessage()]
    size = (32 << 20) - 4096
    assert _reuse_faults()["running"] < size // 4096  # fewer than one buffer's pages


# Page faults of five rounds of malloc, writing the buffer whole, free (after one round not
# counted), in each mode; in a fresh process, whose heap has no free space of an earlier test's.
REUSE = """
import ctypes, json, resource
from nextoken.loader.host_memory import loading_allocations, scratch_allocations
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def faults(size):
    def touch_once():
        p = libc.malloc(size)
        ctypes.memset(p, 1, size)
        libc.free(p)
    touch_once()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        touch_once()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
out = {}
loading_allocations(True)
out["loading"] = faults(4 << 20)
with scratch_allocations():
    out["scratch"] = faults(4 << 20)
out["loading after"] = faults(4 << 20)
loading_allocations(False)
with scratch_allocations():
    out["scratch outside a load"] = faults(16 << 20)
out["running"] = faults((32 << 20) - 4096)
print(json.dumps(out))
"""


@functools.cache
def _reuse_faults() -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", REUSE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.subprocess
def test_a_load_reuses_its_pieces_temporaries():
    """In the loading mode each allocation over 128 KiB that the heap has no room for is a new
    mapping, faulted in again on every use; a conversion in pieces (`scratch_allocations`, what a
    GGUF tensor's de-quantization runs in) reuses the heap's pages for its temporaries, and leaves
    the loading mode as it was. Outside a load it changes nothing."""
    from nextoken.loader.host_memory import libc

    if libc() is None:
        pytest.skip("not glibc: nextoken does not tune malloc here")
    f, pages = _reuse_faults(), (4 << 20) // 4096
    assert f["loading"] >= 5 * pages and f["loading after"] >= 5 * pages  # every round faults its pages
    assert f["scratch"] < pages
    assert f["scratch outside a load"] < (16 << 20) // 4096
