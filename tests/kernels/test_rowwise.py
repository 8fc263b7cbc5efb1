"""The GPU path's row-wise Triton kernels (`kernels.gpu.rowwise`) against their PyTorch references
(`layers.activation`, `layers.rotary`): the same roundings, so the same values but where the
exponential's last bits move a bf16 rounding; the fused projections (`layers.linear.FusedLinear`)
against the separate ones; and a model on the GPU plan's kernels and fused projections against
the same model on PyTorch's.

Without a GPU the kernels' own source runs under Triton's interpreter (``TRITON_INTERPRET=1``,
set by tests/conftest.py); with one (``TRITON_INTERPRET=0``, as benchmarks/gpu_check.py runs
the tests) compiled, on CUDA tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton is a test dependency (pyproject's test extra)")

from nextoken.kernels.gpu.batch_invariant import rms_norm as kernel_norm  # noqa: E402
from nextoken.kernels.gpu.rowwise import Rowwise, act_and_mul, add_rms_norm, apply_rope_qk  # noqa: E402
from nextoken.layers import norm as torch_norm  # noqa: E402
from nextoken.layers.rotary import apply_rope as torch_rope, inv_frequencies, rope_cos_sin  # noqa: E402
from tests.helpers.triton_device import DEV, randn  # noqa: E402

STEP = {torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -22}  # about one unit in the last place, relative


def off_by_at_most_a_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    """Each value within a few units in the last place of the reference's (float32: e^x and the
    formula's order move the last bits; bf16: one rounding), or within 1e-6 of the largest
    (GELU's far tail: PyTorch's tanh form gives 0 where the logistic form gives 1e-11)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    gap, ref = (got.double() - want.double()).abs(), want.double().abs()
    assert (gap <= ref * 4 * STEP[want.dtype] + 1e-6 * ref.max()).all(), gap.max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gelu", [False, True])
def test_act_and_mul_is_pytorchs_expression(dtype, gelu):
    """3 x 700 values (not a multiple of the block), scaled to reach SiLU's and GELU's tails: within
    a few units in the last place of the activation and product taken in float64 and rounded as
    the kernel rounds (in bf16, equal to it for almost every value), and within one bf16 rounding
    of ``F.silu(g) * u`` / ``F.gelu(g, approximate="tanh") * u``. (PyTorch writes GELU as ``0.5 g
    (1 + tanh a)``, which cancels for negative g: near g = -3 it loses about 1e-5 of its float32
    value, so its bf16 roundings differ there; the kernel's logistic form does not cancel.)"""
    g, u = randn(3, 700, dtype=dtype, seed=1, scale=4), randn(3, 700, dtype=dtype, seed=2)
    got = act_and_mul(g, u, gelu=gelu)
    x = g.double()
    exact = x / (1 + torch.exp(-2 * 0.7978845608028654 * (x + 0.044715 * x ** 3))) if gelu else x * torch.sigmoid(x)
    want = (exact.to(dtype).double() * u.double()).to(dtype)
    off_by_at_most_a_rounding(got, want)
    if dtype == torch.bfloat16:
        assert (got == want).float().mean() > 0.99
        off_by_at_most_a_rounding(got, (F.gelu(g, approximate="tanh") if gelu else F.silu(g)) * u)
    gu = torch.cat([g, u], dim=1)  # the halves of a fused gate/up product: rows strided
    assert torch.equal(act_and_mul(gu[:, :700], gu[:, 700:], gelu=gelu), got)
    assert act_and_mul(g[:, ::2], u[:, ::2]) is None  # (columns strided: the caller's PyTorch runs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim,rope_dim", [(64, 64), (80, 32)])
def test_rope_of_queries_and_keys_is_the_rotary_reference(dtype, head_dim, rope_dim):
    """3 query heads and 1 key head of 5 tokens at scattered positions, taken as views of one fused
    q/k/v product (strided rows), full and partial rotation (the dims after `rope_dim` copied):
    `layers.rotary.apply_rope`'s values for each within one rounding (its roundings are the
    kernel's, so bf16 agrees but where a product's float32 rounding differs); and so from tables
    in the inputs' dtype, as the model gives them."""
    qkv = randn(5, (3 + 1 + 1) * head_dim, dtype=dtype, seed=3, scale=2)
    q, k = qkv[:, : 3 * head_dim].view(5, 3, head_dim), qkv[:, 3 * head_dim : 4 * head_dim].view(5, 1, head_dim)
    cos, sin = rope_cos_sin(torch.tensor([0, 7, 100, 2048, 31999], device=DEV), inv_frequencies(rope_dim, 1e4).to(DEV))
    for got, x in zip(apply_rope_qk(q, k, cos, sin), (q, k)):
        off_by_at_most_a_rounding(got, torch_rope(x, cos, sin))
        assert torch.equal(got[..., rope_dim:], x[..., rope_dim:])
    # the model's own tables come in its dtype (`DecoderModel.rope`): taken, the same values
    model_tables = apply_rope_qk(q, k, cos.to(dtype), sin.to(dtype))
    assert model_tables is not None
    assert all(torch.equal(a, b) for a, b in zip(model_tables, apply_rope_qk(q, k, cos, sin)))


@pytest.mark.parametrize("head_dim,rope_dim", [(64, 64), (80, 32)])
def test_rope_writes_the_keys_and_values_into_the_paged_cache(head_dim, rope_dim):
    """With a `KVStore` the same launch writes the rotated keys and the values of 5 tokens (views
    of a fused q/k/v product) at their slots of a 2-head paged cache: the cache equals
    `PagedKVCache.write`'s of the returned keys, every other slot untouched; a store in another
    dtype is left unwritten (the caller's write runs)."""
    from nextoken.layers.attention import KVStore

    hq, hk, t = 4, 2, 5
    qkv = randn(t, (hq + 2 * hk) * head_dim, dtype=torch.bfloat16, seed=40, scale=2)
    q = qkv[:, : hq * head_dim].view(t, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(t, hk, head_dim)
    v = qkv[:, (hq + hk) * head_dim :].view(t, hk, head_dim)
    cos, sin = rope_cos_sin(torch.tensor([3, 4, 9, 10, 11], device=DEV), inv_frequencies(rope_dim, 1e4).to(DEV))
    kc, vc = (randn(hk, 6, 4, head_dim, dtype=torch.bfloat16, seed=41 + i) for i in range(2))
    slots = torch.tensor([21, 2, 7, 8, 0], device=DEV)
    store = KVStore(kc.clone(), vc.clone(), slots, v)
    qo, ko = apply_rope_qk(q, k, cos, sin, store)
    assert store.written and all(torch.equal(a, b) for a, b in zip((qo, ko), apply_rope_qk(q, k, cos, sin)))
    for cache, want_rows, got in ((kc, ko, store.k_cache), (vc, v, store.v_cache)):
        want = cache.clone()
        want.view(hk, -1, head_dim).index_copy_(1, slots, want_rows.transpose(0, 1))
        assert torch.equal(got, want)
    other = KVStore(kc.float(), vc.float(), slots, v)
    apply_rope_qk(q, k, cos, sin, other)
    assert not other.written and torch.equal(other.k_cache, kc.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("form", ["llama", "gemma-post-norm", "gemma-add-alone"])
def test_residual_add_and_norm_in_one_launch_is_the_reference(dtype, form):
    """9 rows of 700 (several programs, a width not a power of two): the residual sum s equals
    PyTorch's ``h + a`` (Gemma's post-norm: ``h + rms_norm_gemma(a)`` within a rounding), and its
    norm y equals the standalone norm kernel of that s bit for bit (tested against PyTorch's
    norms in test_batch_invariant.py) and PyTorch's within a rounding; each row's values are
    the same computed alone (the rows per program do not depend on the batch)."""
    gemma, a_norm, out_norm = form != "llama", form != "llama", form != "gemma-add-alone"
    h, a = randn(9, 700, dtype=dtype, seed=30, scale=3), randn(9, 700, dtype=dtype, seed=31)
    w, wa = randn(700, dtype=dtype, seed=32), randn(700, dtype=dtype, seed=33)
    weight, a_weight = (w if out_norm else None), (wa if a_norm else None)
    s, y = add_rms_norm(h, a, weight, 1e-6, gemma=gemma, a_weight=a_weight)
    ref_s, ref_y = torch_norm.add_rms_norm(h, a, weight, 1e-6, gemma=gemma, a_weight=a_weight)
    if a_norm:
        off_by_at_most_a_rounding(s - h, ref_s - h)  # (the post-norm's mean: one float32 tree sum, as the kernel's)
        assert torch.equal(s, h + kernel_norm(a, wa, 1e-6, gemma=True))
    else:
        assert torch.equal(s, ref_s)
    if out_norm:
        assert torch.equal(y, kernel_norm(s, w, 1e-6, gemma=gemma))
        off_by_at_most_a_rounding(y, (torch_norm.rms_norm_gemma if gemma else torch_norm.rms_norm)(s, w, 1e-6))
        if not a_norm:
            off_by_at_most_a_rounding(y, ref_y)
    else:
        assert y is None and ref_y is None
    s3, y3 = add_rms_norm(h[3:4], a[3:4], weight, 1e-6, gemma=gemma, a_weight=a_weight)
    assert torch.equal(s3, s[3:4]) and (y is None or torch.equal(y3, y[3:4]))
    assert add_rms_norm(h, a.T.contiguous().T, weight, 1e-6) is None  # (strided columns: refused)


def test_layers_take_the_kernels_and_fall_back_counted():
    """`layers.rotary.apply_rope_qk` and `layers.activation.silu_and_mul` given the kernels use
    them; an input they refuse runs PyTorch and is counted as a fallback."""
    from nextoken.kernels import FallbackCounts, counting
    from nextoken.layers.activation import silu_and_mul
    from nextoken.layers.rotary import apply_rope_qk as layer_rope

    g, u = randn(4, 64, dtype=torch.bfloat16, seed=4), randn(4, 64, dtype=torch.bfloat16, seed=5)
    counts = FallbackCounts()
    with counting(counts):
        off_by_at_most_a_rounding(silu_and_mul(g, u, kernel=Rowwise), F.silu(g) * u)
        assert torch.equal(silu_and_mul(g.T, u.T, kernel=Rowwise), F.silu(g.T) * u.T)
        q, k = g.view(4, 2, 32), u[:, :32].reshape(4, 1, 32)
        cos, sin = rope_cos_sin(torch.arange(4, device=DEV), inv_frequencies(32, 1e4).to(DEV))
        got = layer_rope(q, k, cos, sin, kernel=Rowwise)
        assert all(torch.equal(a, b) for a, b in zip(got, apply_rope_qk(q, k, cos, sin)))
        assert all(torch.equal(a, torch_rope(x, cos, sin))  # (float64 angles: not taken)
                   for a, x in zip(layer_rope(q, k, cos.double(), sin.double(), kernel=Rowwise), (q, k)))
        h = g.view(2, 128)
        s, y = torch_norm.add_rms_norm(h, u.view(2, 128), u[0, :32].repeat(4), 1e-6, kernel=Rowwise)
        assert s.is_contiguous() and torch.equal(s, h + u.view(2, 128))
        assert torch.equal(torch_norm.add_rms_norm(h.T, u.view(2, 128).T, u[:, 0].repeat(32)[:2], 1e-6,
                                                   kernel=Rowwise)[0], (h + u.view(2, 128)).T)
    assert counts.snapshot() == {"silu_and_mul": 1, "apply_rope": 1, "add_rms_norm": 1}


def test_fused_linears_equal_the_separate_ones_and_share_their_memory():
    """q/k/v-like linears with biases as one matmul: the separate outputs (float32), each linear's
    weight now rows of the fused one (no memory added; each still runs alone), unused while a
    pass's adapters sit on one of them; refused for a linear that is not plainly dense."""
    from types import SimpleNamespace

    from nextoken.layers.linear import FusedLinear, Linear
    from nextoken.layers.quantization.methods import InvariantMethod

    parts = [Linear(16, n, True, torch.float32) for n in (12, 4, 4)]
    for i, lin in enumerate(parts):
        lin.weight.data = randn(lin.out_features, 16, dtype=torch.float32, seed=10 + i)
        lin.bias.data = randn(lin.out_features, dtype=torch.float32, seed=20 + i)
    x = randn(5, 16, dtype=torch.float32, seed=9)
    want = [lin(x) for lin in parts]
    fused = FusedLinear.of(parts)
    got = fused(x)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-6 * b.abs().max()
    assert parts[1].weight.data_ptr() == fused.weight[12:].data_ptr() and torch.equal(parts[2](x), want[2])
    assert fused.usable()
    parts[0].lora = SimpleNamespace(batch=SimpleNamespace(ids=[1]))
    assert not fused.usable()
    odd = [Linear(16, 4, False, torch.float32), Linear(16, 4, False, torch.float32)]
    odd[1].method = InvariantMethod()
    assert FusedLinear.of(odd) is None


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_a_model_on_the_gpu_plans_rowwise_kernels_equals_pytorchs(tiny_gguf, arch, monkeypatch):
    """A whole model on the GPU path with the plan's row-wise kernels, fused projections and GEMV
    (Qwen 2: RMSNorm, SwiGLU, RoPE, q/k/v with biases; Gemma 3: its norms with the float32
    product, QK-norm, GeGLU, two RoPE tables) against the same path on PyTorch's: float32 logits
    of a prompt (PyTorch's matmuls: 9 rows) and two decodes (the GEMV) within 1e-5; Qwen 2 in
    bf16 too (the model's RoPE tables in bf16, as a GPU runs it; the prompt's 9 rows on the
    split-K GEMM): no kernel refuses its inputs and the logits are PyTorch's bf16 path's."""
    import dataclasses

    from nextoken.kernels.gpu.gemv import MAX_ROWS
    from nextoken.layers.linear import gemv_targets
    from nextoken.loader.source import open_model
    from nextoken.runner import plan as plan_module
    from nextoken.runner.device import resolve_device
    from nextoken.runner.model_runner import ModelRunner
    from tests.tiny_models import OneSequence

    path = str(tiny_gguf[arch][0])
    kw = dict(enforce_eager=True, attention_backend="triton", device=resolve_device(DEV))  # (eager: PyTorch's)
    plain = ModelRunner(open_model(path), torch.float32, **kw)
    plain_half = OneSequence(ModelRunner(open_model(path), torch.bfloat16, **kw), 32, block_size=4) \
        if arch == "qwen2" else None
    choose = plan_module.ExecutionPlan.choose.__func__
    monkeypatch.setattr(plan_module.ExecutionPlan, "choose", classmethod(
        lambda cls, *a, **k: dataclasses.replace(choose(cls, *a, **k), rowwise=True, fused=True, gemv=True,
                                                 skinny=True)))
    fused = ModelRunner(open_model(path), torch.float32, **kw)
    line = fused.plan.describe(fused.model)
    assert "Triton (with RoPE)" in line and "fused matmuls" in line and not plain.plan.rowwise, line
    shapes = {(tuple(t.weight.shape), t.bias is not None) for t in gemv_targets(fused.model)}
    if DEV == "cpu":  # (every shape takes it, untimed; on a GPU each as its timing says)
        assert f"GEMV for decodes of few rows on {len(shapes)} of {len(shapes)} weight shapes, untimed" in line, line
        assert len(shapes) >= 3 and all(t.gemv_rows == MAX_ROWS for t in gemv_targets(fused.model))
    else:
        assert f" of {len(shapes)} weight shapes, as timed on this GPU" in line, line
    a, b = OneSequence(plain, 32, block_size=4), OneSequence(fused, 32, block_size=4)
    launches, stored = [], []
    monkeypatch.setattr(Rowwise, "add_rms_norm", staticmethod(
        lambda *args, _f=Rowwise.add_rms_norm, **kw: launches.append(1) or _f(*args, **kw)))
    import nextoken.layers.gpu_attention as gpu_attention

    attend = gpu_attention.attend_triton
    monkeypatch.setattr(gpu_attention, "attend_triton", lambda *args: stored.append(args[-2:]) or attend(*args))
    import nextoken.models.llama as llama

    fused_downs = []  # (Qwen 2's decodes: SwiGLU's product read by the down projection's GEMV, one launch)
    monkeypatch.setattr(llama, "silu_mul_down", lambda *args, _f=llama.silu_mul_down: fused_downs.append(
        _f(*args)) or fused_downs[-1])
    prompts = ([5, 17, 200, 33, 41, 270, 90, 12, 7], [44], [61])
    wants = [a.forward(ids, all_logits=True) for ids in prompts]
    stored.clear()
    for ids, want in zip(prompts, wants):
        got = b.forward(ids, all_logits=True)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    # (each full-attention layer's keys and values written by the RoPE launch; a sliding layer's ring by attend)
    assert stored and all(done != sliding for sliding, done in stored), stored
    layers = fused.model.config.num_layers  # every residual add inside a norm's launch: a pass's adds, one each
    # (Qwen 2: after attention, and the feed-forward's in the next layer's input norm or the final
    # norm; Gemma 3: both with their post-norms)
    assert len(launches) == 3 * 2 * layers and len(stored) == 3 * layers, (len(launches), len(stored), layers)
    if arch == "qwen2":  # (the prompt's 9 rows: no GEMV, so no fused launch asked for; each decode: one a
        # layer, where the down projection's shape takes the GEMV: every shape here, as timed on a GPU)
        takes = fused.model.layers[0].mlp.down_proj.silu_rows > 0
        assert [y is not None for y in fused_downs] == [True] * 2 * layers * takes, fused_downs
    else:  # (GeGLU's product stays a launch of its own)
        assert not fused_downs
    if arch != "qwen2":  # (Gemma 3's six layers under the interpreter: gpu_check logs a GPU run's fallbacks)
        return
    # in bf16, as a GPU runs it: every kernel takes its inputs (the model's bf16 RoPE tables
    # included: the runner's own count of fallbacks stays empty), near PyTorch's bf16 expressions
    half = OneSequence(ModelRunner(open_model(path), torch.bfloat16, **kw), 32, block_size=4)
    line = half.runner.plan.describe(half.runner.model)
    assert "split-K GEMM for 5-64 rows" in line
    roped = []  # (each decode's q/k/v with RoPE and the cache's write in one launch, where the plan says so)
    monkeypatch.setattr(llama, "qkv_rope", lambda *args, _f=llama.qkv_rope: roped.append(_f(*args)) or roped[-1])
    for ids in ([5, 17, 200, 33, 41, 270, 90, 12, 7], [44], [61]):
        got, want = half.forward(ids, all_logits=True).float(), plain_half.forward(ids, all_logits=True).float()
        # (here equal: the same roundings; a GPU's exponentials and sums move last bits, which grow)
        assert (got - want).abs().max() <= (2 ** -6 if DEV == "cpu" else 0.1) * want.abs().max()
    takes = "RoPE and the cache's write inside the q/k/v GEMV" in line
    assert takes == (DEV == "cpu" or "RoPE in a launch of its own" not in line), line
    assert [y is not None for y in roped] == ([False] * layers + [True] * 2 * layers) * takes, roped
    assert half.runner.plan.kernels.fallbacks.snapshot() == {}, half.runner.plan.kernels.fallbacks.snapshot()
