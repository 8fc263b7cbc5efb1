"""The GPU path's GEMV (`kernels.gpu.gemv`) against ``torch.nn.functional.linear`` and float64, the
dense matmul's switch to it (`layers.quantization.methods.dense_matmul`), and the plan's choice
per weight shape (`kernels.gpu.gemv.choose`).

Without a GPU the kernel's own source runs under Triton's interpreter (``TRITON_INTERPRET=1``,
set by tests/conftest.py); with one (``TRITON_INTERPRET=0``, as benchmarks/gpu_check.py runs the
tests) compiled, on CUDA tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="Triton is a test dependency (pyproject's test extra)")

from nextoken.kernels.gpu.gemv import DEFAULT, INTERPRET_ROWS, LAUNCHES, MAX_ROWS, ROWS, choose, gemv, takes  # noqa: E402
from tests.helpers.triton_device import DEV, randn  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_is_the_linear_in_float32_sums(dtype, m, bias):
    """m rows times a weight of 37 x 1100 (neither a multiple of the program's rows nor of its K
    chunk), with and without a bias, at the GPU's rows per program (4; 1 and 2 too for 1 or 3
    rows with a bias) and the interpreter's: within float32's rounding of the float64 product
    (float32), or that product rounded to bf16 but where one rounding differs (bf16, against
    which PyTorch's own bf16 linear is held too on the CPU)."""
    x = randn(m, 1100, dtype=dtype, seed=1)
    w = randn(37, 1100, dtype=dtype, seed=2, scale=0.1)
    b = randn(37, dtype=dtype, seed=3) if bias else None
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    for rows in (ROWS, INTERPRET_ROWS) + ((1, 2) if bias and m in (1, 3) else ()):  # (each its own K chunk)
        got = gemv(x, w, b, rows=rows)
        assert got.shape == (m, 37) and got.dtype == dtype and got.is_contiguous()
        if dtype == torch.float32:
            assert ((got.double() - exact).abs() <= 1e-5 * exact.abs().max()).all()
        else:
            step = exact.abs() * 2.0 ** -7 + 1e-6 * exact.abs().max()  # one bf16 rounding of the float32 sum
            for y in (got, F.linear(x, w, b)) if DEV == "cpu" else (got,):  # (cuBLAS: see test_skinny.py)
                assert ((y.double() - exact).abs() <= step).all()
            assert (got == exact.to(dtype)).float().mean() > 0.9


@pytest.mark.parametrize("launch", [x for x in LAUNCHES[1:] if (x.tile, x.num_warps) != (DEFAULT.tile, DEFAULT.num_warps)],
                         ids=str)
def test_every_launch_is_the_same_linear(launch):
    """Each launch `choose` may time (a K chunk of ``tile / rows``: 256 to 8192 values against K =
    1100) computes the same linear: 3 bf16 rows with a bias, at 4 and 1 rows per program and its
    own, within one bf16 rounding of the float64 product. (The launches that differ from the
    default in programs per multiprocessor alone run the default's kernel at other rows per
    program, which these rows per program cover.)"""
    x = randn(3, 1100, dtype=torch.bfloat16, seed=31)
    w = randn(37, 1100, dtype=torch.bfloat16, seed=32, scale=0.1)
    b = randn(37, dtype=torch.bfloat16, seed=33)
    exact = x.double() @ w.double().T + b.double()
    step = exact.abs() * 2.0 ** -7 + 1e-6 * exact.abs().max()
    for rows in (ROWS, 1):
        got = gemv(x, w, b, rows=rows, launch=launch)
        assert got.shape == (3, 37) and ((got.double() - exact).abs() <= step).all()
    assert ((gemv(x, w, b, launch=launch).double() - exact).abs() <= step).all()  # (its own rows per program)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 3])
def test_the_gemv_of_swiglus_product_is_the_two_launches(dtype, m):
    """With `up`, the GEMV's input is ``silu(gate) * up`` read from the halves of a fused
    gate/up product (strided rows), scaled to reach SiLU's tails: the same values as
    `rowwise.act_and_mul` then the GEMV (in bf16 bit for bit: the same roundings), and within
    the roundings of float64's product of the two. A gate and up of other shapes are refused."""
    from nextoken.kernels.gpu.gemv import Refused
    from nextoken.kernels.gpu.rowwise import act_and_mul

    gu = randn(m, 2 * 700, dtype=dtype, seed=50, scale=4)
    gate, up = gu[:, :700], gu[:, 700:]
    w = randn(37, 700, dtype=dtype, seed=51, scale=0.1)
    want = gemv(act_and_mul(gate, up), w)
    for rows in (ROWS, INTERPRET_ROWS, 1):
        got = gemv(gate, w, rows=rows, up=up)
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:  # (numpy's float32 e^x, the interpreter's, can differ in a last bit between array shapes)
            assert torch.allclose(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    g = gate.double()
    product = g * torch.sigmoid(g) * up.double()
    exact, sizes = product @ w.double().T, product.abs() @ w.double().abs().T
    step = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20  # (bf16: each product rounded, twice, then the sum)
    assert ((want.double() - exact).abs() <= sizes * step).all()
    with pytest.raises(Refused):
        gemv(gate, w, up=up[:, :699])


def test_gemv_refuses_what_it_does_not_take():
    """More rows than `MAX_ROWS`, a weight in another dtype, strided rows: `takes` says no and
    `gemv` raises a ValueError naming the call."""
    x, w = randn(MAX_ROWS + 1, 64, dtype=torch.float32, seed=4), randn(8, 64, dtype=torch.float32, seed=5)
    assert not takes(x, w, None) and takes(x[:MAX_ROWS], w, None)
    assert not takes(x[:2], w.to(torch.bfloat16), None) and not takes(x[:2, ::2], w[:, ::2], None)
    with pytest.raises(ValueError, match="it takes 1-4 rows"):
        gemv(x, w)


def test_dense_matmul_switches_by_rows():
    """`dense_matmul` runs the GEMV for calls of at most `gemv_rows` rows that it takes, and
    PyTorch's matmul otherwise (more rows, `gemv_rows` 0, a call it does not take: counted)."""
    from nextoken.kernels import FallbackCounts, counting
    from nextoken.layers.quantization.methods import dense_matmul

    x, w = randn(6, 96, dtype=torch.bfloat16, seed=6), randn(40, 96, dtype=torch.bfloat16, seed=7)
    assert torch.equal(dense_matmul(x[:2], w, None, 4), gemv(x[:2], w))
    for rows, got in ((x[:3], dense_matmul(x[:3], w, None, 2)), (x, dense_matmul(x, w, None, 4)),
                      (x[:1], dense_matmul(x[:1], w, None, 0))):
        assert torch.equal(got, F.linear(rows, w))
    counts, strided = FallbackCounts(), x[:2].T.contiguous().T  # (columns strided)
    with counting(counts):
        assert torch.equal(dense_matmul(strided, w, None, 4), F.linear(strided, w))
    assert counts.snapshot() == {"gemv": 1}


def test_choose_times_every_launch_and_keeps_the_gemv_up_to_the_first_row_count_it_loses(monkeypatch):
    """With a timer under which, on one shape, one launch is the fastest at one row, another
    raises (it does not build), and the GEMV launched the fastest way beats PyTorch's at 1 and 2
    rows and loses at 4, the choice is (2, that launch); on a shape where every launch loses at
    once, (0, the fastest). Each timing runs over all the group's weights; the report holds
    every launch that ran and PyTorch's time at one row. A shape where every launch raises
    raises."""
    import nextoken.kernels.gpu.gemv as G

    fast, broken = LAUNCHES[3], LAUNCHES[1]
    calls = []

    def ours(x, weight, bias, launch=None):
        if launch is broken:
            raise RuntimeError("out of resources")
        calls.append((launch, x.shape[0], weight.shape[0]))

    monkeypatch.setattr(G, "gemv", ours)
    monkeypatch.setattr(torch.nn.functional, "linear",
                        lambda x, weight, bias: calls.append(("torch", x.shape[0], weight.shape[0])))

    def speed(kind, rows, n):
        if kind == "torch":
            return 2.0
        base = 1.0 if kind is fast else 1.5
        return base * {1: 1, 2: 1.5, 4: 3}[rows] if n == 16 else base * 3

    def timer(fn):
        before = len(calls)
        fn()
        ran = calls[before:]
        assert len(ran) == 3 and len(set(ran)) == 1  # every weight of the group, one kind, one row count
        return speed(*ran[0])

    groups = {"a": [(randn(16, 32, dtype=torch.float32, seed=8 + i), None) for i in range(3)],
              "b": [(randn(8, 32, dtype=torch.float32, seed=20 + i), None) for i in range(3)]}
    report = {}
    assert choose(groups, timer=timer, report=report) == {"a": (2, fast), "b": (0, fast)}
    assert set(report) == {"a", "b"} and report["a"]["torch"] == 2.0 and report["a"][str(fast)] == 1.0
    assert str(broken) not in report["a"] and len(report["a"]) == len(LAUNCHES)  # (the others and PyTorch's)
    assert {launch for launch, m, n in calls if m > 1} == {fast, "torch"}  # (more rows: the chosen launch alone)

    def every_launch_broken(x, weight, bias, launch=None):
        raise RuntimeError("ptxas failed")

    monkeypatch.setattr(G, "gemv", every_launch_broken)
    with pytest.raises(RuntimeError, match="ptxas failed"):
        choose(groups, timer=timer)


def test_choose_times_a_shape_once_a_process(monkeypatch):
    """With the GPU's own timer (`timing.graph_seconds`, a stand-in here), a second engine's load
    of the same weight shapes on the same device reuses the first's choice and report without
    timing again (`timing.remembered`); another shape (or another count of weights) is timed."""
    import nextoken.kernels.gpu.gemv as G
    import nextoken.kernels.gpu.timing as T

    monkeypatch.setattr(T, "_CHOICES", {})
    monkeypatch.setattr(G, "gemv", lambda x, weight, bias, launch=None: None)
    timed = []
    monkeypatch.setattr(T, "graph_seconds", lambda fn: timed.append(fn()) or 1.0)
    group = [(randn(16, 32, dtype=torch.float32, seed=40 + i), None) for i in range(2)]
    first, report = choose({"a": group}), {}
    n = len(timed)
    assert n and choose({"b": [(w.clone(), b) for w, b in group]}, report=report) == {"b": first["a"]}
    assert len(timed) == n and set(report) == {"b"} and "torch" in report["b"]
    choose({"c": group[:1]})
    assert len(timed) > n


def test_the_plan_gives_each_shape_its_timed_rows_or_none_when_timing_fails(tiny_gguf, monkeypatch):
    """On a GPU the plan times every weight shape (`choose`, here a stand-in: its timing needs
    CUDA) and gives each matmul its group's rows and launch; should the timing raise (a kernel that
    does not build there), every matmul stays on PyTorch's and the plan line says why. The fused
    projections and the linears outside them are the groups; a fused group's parts are not."""
    import dataclasses

    import nextoken.kernels.gpu.gemv as G
    from nextoken.layers.linear import FusedLinear, gemv_targets
    from nextoken.loader.source import open_model
    from nextoken.runner.device import Device, resolve_device
    from nextoken.runner.model_runner import ModelRunner

    runner = ModelRunner(open_model(str(tiny_gguf["qwen2"][0])), torch.float32, enforce_eager=True,
                         attention_backend="triton", device=resolve_device(DEV))  # (compiled: on the GPU)
    model = runner.model
    for m in model.modules():
        if hasattr(m, "qkv"):
            m.qkv = FusedLinear.of([m.q_proj, m.k_proj, m.v_proj])
    gpu = dataclasses.replace(runner.plan, device=Device(torch.device("cuda"), "a GPU", "asked for"), gemv=True)
    seen = {}

    def timed(groups, report=None):
        seen.update(groups)
        report.update({key: {"torch": 1.0} for key in groups})
        return {key: (2, LAUNCHES[2]) if key[1] else (1, DEFAULT) for key in groups}  # (a bias: the fused q/k/v)

    monkeypatch.setattr(G, "choose", timed)
    assert gpu._choose_gemv(model) == (len(seen), len(seen))
    targets = gemv_targets(model)
    parts = {id(lin) for m in model.modules() if getattr(m, "qkv", None) for lin in m.qkv.linears}
    assert sum(len(v) for v in seen.values()) == len(targets) and not parts & {id(t) for t in targets}
    assert {(t.gemv_rows, t.gemv_launch) for t in targets if t.bias is not None} == {(2, LAUNCHES[2])}
    assert {(t.gemv_rows, t.gemv_launch) for t in targets if t.bias is None} == {(1, DEFAULT)}
    assert set(gpu.gemv_times) == set(seen)

    def broken(groups, report=None):
        raise RuntimeError("ptxas failed")

    monkeypatch.setattr(G, "choose", broken)
    assert gpu._choose_gemv(model) == (0, len(seen))
    assert all(t.gemv_rows == 0 and t.gemv_launch is None for t in targets)
    assert "GEMV off: RuntimeError: ptxas failed" in gpu.describe(model)


def test_choose_silu_keeps_silu_inside_the_gemv_up_to_the_first_row_count_it_loses(monkeypatch):
    """`choose_silu` times the down projections with SwiGLU's product inside the GEMV against the
    activation's own launch and then the GEMV, over every weight of the group: with the fused
    GEMV faster at 1 and 2 rows and slower at 4, up to 2 rows; never past the GEMV's own rows;
    none when it loses at one row. The report has both times at one row."""
    import nextoken.kernels.gpu.gemv as G
    import nextoken.kernels.gpu.rowwise as R

    calls = []
    monkeypatch.setattr(G, "gemv", lambda x, weight, bias, launch=None, up=None: calls.append(
        ("fused" if up is not None else "gemv", x.shape[0])))
    monkeypatch.setattr(R, "act_and_mul", lambda g, u: calls.append(("act", g.shape[0])) or g)
    pairs = [(randn(16, 32, dtype=torch.float32, seed=60 + i), None) for i in range(3)]

    def timer_with(fused_at):
        return stand_in_timer(calls, lambda rows: [("fused", rows)] * 3,
                              lambda rows: [("act", rows), ("gemv", rows)] * 3, fused_at)

    rows, times = G.choose_silu(pairs, None, 4, timer=timer_with({1: 0.8, 2: 0.9, 4: 1.1}))
    assert rows == 2 and times == {"fused": 0.8, "apart": 1.0}
    assert G.choose_silu(pairs, None, 1, timer=timer_with({1: 0.8, 2: 0.9, 4: 0.9}))[0] == 1
    assert G.choose_silu(pairs, None, 4, timer=timer_with({1: 1.2, 2: 0.5, 4: 0.5}))[0] == 0


def stand_in_timer(calls: list, fused, apart, fused_at: dict):
    """A timer for `choose_silu` and `choose_rope` whose timed function records its calls in
    `calls` (each ``(kind, rows, ...)``): a timing whose calls are ``fused(rows)`` takes
    ``fused_at[rows]`` seconds, one whose calls are ``apart(rows)`` 1 second."""
    def timer(fn):
        before = len(calls)
        fn()
        ran = calls[before:]
        rows = ran[0][1]
        if ran[0][0] == "fused":
            assert ran == fused(rows)
            return fused_at[rows]
        assert ran == apart(rows)
        return 1.0
    return timer


def test_the_plan_gives_silu_inside_the_gemv_where_timed_faster(tiny_gguf, monkeypatch):
    """Off a GPU the SwiGLU down projections on the GEMV take SiLU inside it at every GEMV row
    count (the GPU path's tests run it); on a GPU, the rows `choose_silu` timed (a stand-in here),
    said on the plan line; a timing that raises leaves the two launches, and says why. Linears
    that are not a SwiGLU down projection never take it."""
    import dataclasses

    import nextoken.kernels.gpu.gemv as G
    from nextoken.layers.linear import Linear
    from nextoken.loader.source import open_model
    from nextoken.runner.device import Device, resolve_device
    from nextoken.runner.model_runner import ModelRunner

    runner = ModelRunner(open_model(str(tiny_gguf["qwen2"][0])), torch.float32, enforce_eager=True,
                         attention_backend="triton", device=resolve_device(DEV))
    model = runner.model
    downs = [m.mlp.down_proj for m in model.layers]
    others = [m for m in model.modules() if isinstance(m, Linear) and all(m is not d for d in downs)]
    here = dataclasses.replace(runner.plan, gemv=True, silu_rows={}, silu_times={})
    here._choose_gemv(model)
    here._choose_silu(model)
    if DEV == "cpu":
        assert all(d.silu_rows == d.gemv_rows == MAX_ROWS for d in downs) and not any(m.silu_rows for m in others)
    gpu = dataclasses.replace(runner.plan, device=Device(torch.device("cuda"), "a GPU", "asked for"), gemv=True,
                              silu_rows={}, silu_times={})
    seen = []

    def timed(pairs, launch, max_rows):
        seen.append((len(pairs), max_rows))
        return 1, {"fused": 1.0, "apart": 2.0}

    monkeypatch.setattr(G, "choose_silu", timed)
    gpu._choose_silu(model)
    assert seen == [(len(downs), downs[0].gemv_rows)] and all(d.silu_rows == 1 for d in downs)
    assert "SiLU inside the down projection's GEMV up to 1 rows" in gpu.describe(model)
    assert list(gpu.silu_times.values()) == [{"fused": 1.0, "apart": 2.0}]
    monkeypatch.setattr(G, "choose_silu", lambda pairs, launch, max_rows: (0, {"fused": 2.0, "apart": 1.0}))
    gpu._choose_silu(model)
    assert all(d.silu_rows == 0 for d in downs) and "SiLU in a launch of its own: it timed slower" in \
        gpu.describe(model)
    gpu.silu_rows.clear()

    def broken(pairs, launch, max_rows):
        raise RuntimeError("ptxas failed")

    monkeypatch.setattr(G, "choose_silu", broken)
    gpu._choose_silu(model)
    assert all(d.silu_rows == 0 for d in downs) and "SiLU in the GEMV off: RuntimeError: ptxas failed" in \
        gpu.describe(model)


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("rope_dim,bias,store,cos_dtype,pairs", [(16, True, True, torch.bfloat16, None),
                                                                 (16, True, True, torch.bfloat16, 1),
                                                                 (8, False, True, torch.float32, None),
                                                                 (16, False, False, torch.bfloat16, None)])
def test_the_gemv_with_rope_is_the_gemv_then_the_rope_kernel(m, rope_dim, bias, store, cos_dtype, pairs):
    """`gemv_rope` (q/k/v, RoPE on the query and key heads, the keys and values into the paged
    cache, in one launch) gives the bits of `gemv` and then `rowwise.apply_rope_qk` with its cache
    store: Qwen 2's biases, a partial rotary (8 of 16 dims; float32 tables), no store (a sliding
    layer's), 1-4 rows at distinct slots, one pair of features a program (a GPU's) or several
    (the interpreter's default); the cache's other slots untouched."""
    from nextoken.kernels.gpu.gemv import gemv_rope
    from nextoken.kernels.gpu.rowwise import apply_rope_qk
    from nextoken.layers.attention import KVStore

    hq, hkv, d, k = 4, 2, 16, 64
    n = (hq + 2 * hkv) * d
    x = randn(m, k, dtype=torch.bfloat16, seed=70)
    w = randn(n, k, dtype=torch.bfloat16, seed=71, scale=0.2)
    b = randn(n, dtype=torch.bfloat16, seed=72) if bias else None
    pos = torch.arange(m, device=DEV, dtype=torch.float32)[:, None] * 3 + 5
    inv = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2, device=DEV, dtype=torch.float32) / rope_dim))
    ang = torch.cat([pos * inv, pos * inv], 1)
    cos, sin = ang.cos().to(cos_dtype), ang.sin().to(cos_dtype)
    slots = torch.tensor([9, 2, 14, 5][:m], dtype=torch.int64, device=DEV)

    def cache():
        return [randn(hkv, 4, 4, d, dtype=torch.bfloat16, seed=73 + i) for i in range(2)]

    want_cache, got_cache = cache(), cache()
    plain = gemv(x, w, b, rows=2)  # (two features a program: the fused launch's K chunk, so its sums' order)
    q, kk, v = plain.split([hq * d, hkv * d, hkv * d], 1)
    q, kk, v = q.view(m, hq, d), kk.view(m, hkv, d), v.view(m, hkv, d)
    s_want = KVStore(*want_cache, slots, v) if store else None
    q_want, k_want = apply_rope_qk(q, kk, cos, sin, s_want)
    s_got = KVStore(*got_cache, slots, None) if store else None
    got = gemv_rope(x, w, b, cos, sin, d, hq * d, hkv * d, s_got, pairs=pairs)
    assert torch.equal(got[:, : hq * d].view(m, hq, d), q_want)
    assert torch.equal(got[:, hq * d : (hq + hkv) * d].view(m, hkv, d), k_want)
    assert torch.equal(got[:, (hq + hkv) * d :], plain[:, (hq + hkv) * d :])
    if store:
        assert s_want.written and s_got.written
        assert torch.equal(got_cache[0], want_cache[0]) and torch.equal(got_cache[1], want_cache[1])
    else:
        assert all(torch.equal(a, b) for a, b in zip(got_cache, cache()))


def test_choose_rope_keeps_rope_inside_the_gemv_up_to_the_first_row_count_it_loses(monkeypatch):
    """`choose_rope` times the q/k/v products with RoPE and the cache's write inside the GEMV
    against the GEMV and then the RoPE kernel with its store, over every weight of the group, up
    to the GEMV's own rows; the report has both times at one row."""
    import nextoken.kernels.gpu.gemv as G
    import nextoken.kernels.gpu.rowwise as R

    calls = []
    monkeypatch.setattr(G, "gemv_rope", lambda x, w, b, cos, sin, d, q, kv, store, launch=None, pairs=None:
                        calls.append(("fused", x.shape[0], cos.shape, store.k_cache.shape)))
    monkeypatch.setattr(G, "gemv", lambda x, w, b, rows=None, launch=None: calls.append(  # (timed as the model
        ("gemv", x.shape[0]) if rows is None else ("gemv, not the model's launch", rows)) or torch.zeros(  # runs it)
        x.shape[0], w.shape[0]))
    monkeypatch.setattr(R, "apply_rope_qk", lambda q, k, cos, sin, store: calls.append(("rope", q.shape, k.shape))
                        or (q, k))
    weights = [(randn(64, 32, dtype=torch.bfloat16, seed=80 + i), None) for i in range(2)]  # 2 q heads, 1 kv head, 16 dims

    def timer_with(fused_at):
        return stand_in_timer(calls, lambda rows: [("fused", rows, (rows, 8), (1, 8, 16, 16))] * 2,
                              lambda rows: [("gemv", rows), ("rope", (rows, 2, 16), (rows, 1, 16))] * 2, fused_at)

    rows, times = G.choose_rope(weights, 16, 32, 16, 8, None, 4, timer=timer_with({1: 0.5, 2: 0.5, 4: 1.5}))
    assert rows == 2 and times == {"fused": 0.5, "apart": 1.0}
    assert G.choose_rope(weights, 16, 32, 16, 8, None, 4, timer=timer_with({1: 1.5, 2: 0.5, 4: 0.5}))[0] == 0


def test_the_plan_gives_rope_inside_the_qkv_gemv_where_timed_faster(tiny_gguf, monkeypatch):
    """A bf16 plan with the Triton RoPE gives each fused q/k/v on the GEMV the rows `choose_rope`
    timed (a stand-in here: its heads, their RoPE dims and the GEMV's rows), said on the plan
    line; slower: RoPE keeps its launch, said so; a timing that raises leaves the two launches
    and says why."""
    import dataclasses

    import nextoken.kernels.gpu.gemv as G
    from nextoken.kernels.gpu.rowwise import Rowwise
    from nextoken.layers.linear import FusedLinear
    from nextoken.loader.source import open_model
    from nextoken.runner.device import Device, resolve_device
    from nextoken.runner.model_runner import ModelRunner

    runner = ModelRunner(open_model(str(tiny_gguf["qwen2"][0])), torch.bfloat16, enforce_eager=True,
                         attention_backend="triton", device=resolve_device(DEV))
    model, cfg = runner.model, runner.model.config
    attns = [m.self_attn for m in model.layers]
    for a in attns:
        a.qkv, a.rope_kernel = FusedLinear.of([a.q_proj, a.k_proj, a.v_proj]), Rowwise
        a.qkv.gemv_rows = MAX_ROWS
    gpu = dataclasses.replace(runner.plan, device=Device(torch.device("cuda"), "a GPU", "asked for"), gemv=True,
                              rope_rows={}, rope_times={}, silu_rows={}, silu_times={}, reasons={})
    seen = []

    def timed(weights, d, q, kv, rope_dim, launch, max_rows):
        seen.append((len(weights), d, q, kv, rope_dim, max_rows))
        return 2, {"fused": 1.0, "apart": 2.0}

    monkeypatch.setattr(G, "choose_rope", timed)
    gpu._choose_rope(model)
    d = cfg.head_dim
    assert seen == [(len(attns), d, cfg.num_heads * d, cfg.num_kv_heads * d, cfg.rope_dim, MAX_ROWS)]
    assert all(a.qkv.rope_rows == 2 for a in attns)
    assert "RoPE and the cache's write inside the q/k/v GEMV up to 2 rows" in gpu.describe(model)
    monkeypatch.setattr(G, "choose_rope", lambda *args: (0, {"fused": 2.0, "apart": 1.0}))
    gpu._choose_rope(model)
    assert all(a.qkv.rope_rows == 0 for a in attns) and "RoPE in a launch of its own" in gpu.describe(model)
    gpu.rope_rows.clear()

    def broken(*args):
        raise RuntimeError("ptxas failed")

    monkeypatch.setattr(G, "choose_rope", broken)
    gpu._choose_rope(model)
    assert all(a.qkv.rope_rows == 0 for a in attns) and "RoPE in the GEMV off: RuntimeError: ptxas failed" in \
        gpu.describe(model)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("case", ["llama", "gemma post-norm", "gemma post-norm alone", "bias and swiglu"])
def test_the_gemv_with_the_add_and_norm_after_it_is_the_two_launches(m, case):
    """`gemv_add_norm`: the product, then the residual add and RMSNorm over whole rows joined by
    the GEMV's last program, bit for bit `gemv` then `rowwise.add_rms_norm` (Llama's norm;
    Gemma 3's post-norm before the add, with and without a norm after it; a bias and SwiGLU's
    product as the input), over a width that is not a power of two; its ticket back at 0 after
    each launch. On a GPU 200 launches, new inputs each: a join that read another program's
    output before it was stored would show. float32 and 8-warp launches are refused."""
    from nextoken.kernels.gpu.gemv import Launch, Refused, gemv_add_norm, tickets
    from nextoken.kernels.gpu.rowwise import add_rms_norm

    n, k = 96, 200
    gemma, post, after = case.startswith("gemma"), case.startswith("gemma"), case != "gemma post-norm alone"
    swiglu = case == "bias and swiglu"
    w = randn(n, k, dtype=torch.bfloat16, seed=90, scale=0.1)
    b = randn(n, dtype=torch.bfloat16, seed=91) if swiglu else None
    nw = (randn(n, dtype=torch.bfloat16, seed=92, scale=0.2) + 1).to(torch.bfloat16) if after else None
    aw = (randn(n, dtype=torch.bfloat16, seed=93, scale=0.2) + 1).to(torch.bfloat16) if post else None
    for launch in range(200 if DEV != "cpu" else 2):
        x, up, h = (randn(*shape, dtype=torch.bfloat16, seed=100 + 3 * launch + i, scale=2)
                    for i, shape in enumerate(((m, k), (m, k), (m, n))))
        up = up if swiglu else None
        s, y = gemv_add_norm(x, w, b, h, nw, 1e-6, gemma, aw, up=up)
        s2, y2 = add_rms_norm(h, gemv(x, w, b, up=up), nw, 1e-6, gemma, aw)
        assert torch.equal(s, s2) and ((y is None and y2 is None) or torch.equal(y, y2)), launch
        assert tickets(x.device).item() == 0
    with pytest.raises(Refused):
        gemv_add_norm(x.float(), w.float(), None, h.float(), None, 1e-6)
    with pytest.raises(Refused):
        gemv_add_norm(x, w, b, h, nw, 1e-6, launch=Launch(2048, 8))


def test_choose_norm_keeps_the_add_and_norm_inside_the_gemv_up_to_the_first_row_count_it_loses(monkeypatch):
    """`choose_norm` times the o or down projections with the residual add and RMSNorm joined
    inside the GEMV against the GEMV and then the add-norm kernel, over every weight of the
    group, up to the GEMV's own rows; the report has both times at one row."""
    import nextoken.kernels.gpu.gemv as G
    import nextoken.kernels.gpu.rowwise as R

    calls = []
    monkeypatch.setattr(G, "gemv_add_norm", lambda x, w, b, h, nw, eps, launch=None: calls.append(
        ("fused", x.shape[0], h.shape)))
    monkeypatch.setattr(G, "gemv", lambda x, w, b, launch=None: calls.append(("gemv", x.shape[0])) or torch.zeros(
        x.shape[0], w.shape[0]))
    monkeypatch.setattr(R, "add_rms_norm", lambda h, a, nw, eps: calls.append(("norm", h.shape, a.shape)))
    pairs = [(randn(16, 32, dtype=torch.bfloat16, seed=110 + i), None) for i in range(2)]

    def timer_with(fused_at):
        return stand_in_timer(calls, lambda rows: [("fused", rows, (rows, 16))] * 2,
                              lambda rows: [("gemv", rows), ("norm", (rows, 16), (rows, 16))] * 2, fused_at)

    rows, times = G.choose_norm(pairs, 1e-6, None, 4, timer=timer_with({1: 0.5, 2: 0.5, 4: 1.5}))
    assert rows == 2 and times == {"fused": 0.5, "apart": 1.0}
    assert G.choose_norm(pairs, 1e-6, None, 1, timer=timer_with({1: 0.5, 2: 0.5, 4: 0.5}))[0] == 1
    assert G.choose_norm(pairs, 1e-6, None, 4, timer=timer_with({1: 1.5, 2: 0.5, 4: 0.5}))[0] == 0


def test_the_plan_gives_the_add_and_norm_inside_the_gemv_where_timed_faster(tiny_gguf, monkeypatch):
    """A bf16 plan with the Triton norms gives each o and down projection on the GEMV (its launch
    of `rowwise.ADD_NORM_WARPS` warps) the rows `choose_norm` timed (a stand-in here), said on
    the plan line; off a GPU their GEMV rows; slower: two launches, said so; a timing that raises
    leaves the two launches and says why. Other linears, and a layer on PyTorch's norms, never
    take it."""
    import dataclasses

    import nextoken.kernels.gpu.gemv as G
    from nextoken.kernels.gpu.rowwise import Rowwise
    from nextoken.layers.linear import Linear
    from nextoken.loader.source import open_model
    from nextoken.runner.device import Device, resolve_device
    from nextoken.runner.model_runner import ModelRunner

    runner = ModelRunner(open_model(str(tiny_gguf["qwen2"][0])), torch.bfloat16, enforce_eager=True,
                         attention_backend="triton", device=resolve_device(DEV))
    model = runner.model
    targets = [lin for m in model.layers for lin in (m.self_attn.o_proj, m.mlp.down_proj)]
    others = [m for m in model.modules() if isinstance(m, Linear) and all(m is not t for t in targets)]
    for lin in model.modules():
        if isinstance(lin, Linear):
            lin.gemv_rows = MAX_ROWS
    here = dataclasses.replace(runner.plan, rowwise=True, norm_rows={}, norm_times={}, reasons={})
    here._choose_norm(model)  # (the layers' norms on PyTorch: none)
    assert not any(m.norm_rows for m in targets + others)
    for m in model.layers:
        m.norm_kernel = Rowwise
    if DEV == "cpu":
        here._choose_norm(model)
        assert all(t.norm_rows == MAX_ROWS for t in targets) and not any(m.norm_rows for m in others)
    gpu = dataclasses.replace(runner.plan, device=Device(torch.device("cuda"), "a GPU", "asked for"), gemv=True,
                              rowwise=True, norm_rows={}, norm_times={}, reasons={})
    seen = []

    def timed(pairs, eps, launch, max_rows):
        seen.append((len(pairs), eps, max_rows))
        return 2, {"fused": 1.0, "apart": 2.0}

    monkeypatch.setattr(G, "choose_norm", timed)
    gpu._choose_norm(model)
    eps, layers = model.config.norm_eps, len(model.layers)
    assert sorted(seen) == [(layers, eps, MAX_ROWS)] * 2 and all(t.norm_rows == 2 for t in targets)
    assert "the residual add and RMSNorm after it inside the o and down projections' GEMV up to 2/2 rows" in \
        gpu.describe(model)
    monkeypatch.setattr(G, "choose_norm", lambda *args: (0, {"fused": 2.0, "apart": 1.0}))
    gpu._choose_norm(model)
    assert all(t.norm_rows == 0 for t in targets) and "the add and norm in a launch of its own" in gpu.describe(model)
    gpu.norm_rows.clear()

    def broken(*args):
        raise RuntimeError("ptxas failed")

    monkeypatch.setattr(G, "choose_norm", broken)
    gpu._choose_norm(model)
    assert all(t.norm_rows == 0 for t in targets) and "the add and norm in the GEMV off: RuntimeError: ptxas " \
        "failed" in gpu.describe(model)


def test_a_fusion_is_kept_only_where_it_gives_its_two_launches_values(monkeypatch):
    """At load on a GPU, each fusion's timing first runs it and its two launches at each row count
    on the group's first weight, and raises `Unequal` (the plan then keeps the two launches and
    says why) unless they hold the same bits: a compiler or a race on some card could break what
    the interpreter's tests hold. Here, under the interpreter: SiLU's, RoPE's (its output and both
    scratch caches) and the norm's fusions pass; a norm fusion whose output is off by one bf16
    step, or that leaves the norm out, does not."""
    import nextoken.kernels.gpu.gemv as G

    def once(fn):  # (a timer that runs the timed launches once)
        fn()
        return 1.0

    pairs = [(randn(48, 32, dtype=torch.bfloat16, seed=120 + i, scale=0.2), None) for i in range(2)]
    assert G._choose_silu([(randn(48, 64, dtype=torch.bfloat16, seed=125, scale=0.2), None)], None, 2, once,
                          checked=True)[0] == 0  # (equal times: the fusion is not faster)
    plain, rows_asked = G.gemv, []  # (RoPE's two launches: checked with the GEMV at two features a program, the
    # fused launch's K chunk, which a GPU's sums follow; timed as the model runs it)
    monkeypatch.setattr(G, "gemv", lambda *a, rows=None, **k: rows_asked.append(rows) or plain(*a, rows=rows, **k))
    G._choose_rope([(randn(64, 32, dtype=torch.bfloat16, seed=126, scale=0.2), None)], 16, 32, 16, 8, None, 2, once,
                   checked=True)
    assert rows_asked == [2, None]  # (at one row the check, then the timing; equal times stop there)
    monkeypatch.setattr(G, "gemv", plain)
    G._choose_norm(pairs, 1e-6, None, 2, once, checked=True)
    joined = G.gemv_add_norm
    monkeypatch.setattr(G, "gemv_add_norm", lambda *a, **k: (lambda s, y: (s, y + y.abs() * 2**-7))(*joined(*a, **k)))
    with pytest.raises(G.Unequal, match=r"the add and norm inside the GEMV: \d+ of its values differ"):
        G._choose_norm(pairs, 1e-6, None, 2, once, checked=True)
    monkeypatch.setattr(G, "gemv_add_norm", lambda *a, **k: (joined(*a, **k)[0], None))
    with pytest.raises(G.Unequal, match="all of its values differ"):
        G._choose_norm(pairs, 1e-6, None, 2, once, checked=True)
