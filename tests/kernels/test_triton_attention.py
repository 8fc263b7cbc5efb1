"""Our Triton paged attention (`kernels.gpu.attention`) against attention computed in float64.

On a machine without a GPU the kernel's own source runs under Triton's interpreter
(``TRITON_INTERPRET=1``, set by tests/conftest.py before Triton is imported); with a GPU the
same tests run it compiled (``TRITON_INTERPRET=0``, as benchmarks/gpu_check.py runs them). The
reference gathers each sequence's keys from its block table by hand and applies the masks in
float64: an oracle that shares nothing with the kernel.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is a test dependency (pyproject's test extra)")

from nextoken.kernels.gpu.attention import (  # noqa: E402
    decode_splits, paged_attention, query_tiles, tiling, tilings)

# the interpreter runs CPU tensors; compiled Triton (TRITON_INTERPRET=0 on a GPU) runs CUDA ones
DEVICES = ["cuda"] if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else ["cpu"]


def make_case(q_lens, ctx, *, hkv=2, group=3, d=32, bs=16, dtype=torch.float32, device="cpu", int8=False, seed=0):
    """A batch of sequences (`q_lens` new tokens after `ctx` cached ones each) over a paged cache
    whose blocks are shuffled: q, caches, tables, lengths, offsets."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx, q_lens)]
    need = sum(-(-s // bs) for s in seq_lens)
    nb = need + 3
    shape = (hkv, nb, bs, d)
    if int8:
        k = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        v = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        ks = torch.rand(shape[:-1], generator=g) * 0.02
        vs = torch.rand(shape[:-1], generator=g) * 0.02
    else:
        k, v = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
        ks = vs = None
    perm = torch.randperm(nb, generator=g)
    tables = torch.zeros(len(q_lens), max(-(-s // bs) for s in seq_lens), dtype=torch.int32)
    at = 0
    for i, s in enumerate(seq_lens):
        n = -(-s // bs)
        tables[i, :n] = perm[at : at + n]
        at += n
    q = torch.randn(sum(q_lens), hkv * group, d, generator=g).to(dtype)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    case = dict(q=q, k=k, v=v, ks=ks, vs=vs, tables=tables, seq_lens=seq_lens, qsl=qsl, bs=bs, d=d)
    return {name: x.to(device) if isinstance(x, torch.Tensor) else x for name, x in case.items()}


def keys_of(cache, scales, table, seq_len, bs):
    """A sequence's keys (or values) ``[Hkv, S, D]`` in float64, gathered block by block."""
    rows = []
    for p in range(seq_len):
        b, o = int(table[p // bs]), p % bs
        x = cache[:, b, o].double()
        rows.append(x * scales[:, b, o, None].double() if scales is not None else x)
    return torch.stack(rows, 1)


def reference(case, scale, window=0, softcap=0.0, fresh=None):
    """float64 attention of every sequence of `case`: causal, a sliding `window`, soft-capped
    scores; `fresh` (k, v ``[T, Hkv, D]``): the new tokens' keys come from these rows instead."""
    q, out = case["q"].double(), torch.zeros(case["q"].shape, dtype=torch.float64, device=case["q"].device)
    for i, s in enumerate(case["seq_lens"]):
        a, b = case["qsl"][i], case["qsl"][i + 1]
        k = keys_of(case["k"], case["ks"], case["tables"][i], s, case["bs"])
        v = keys_of(case["v"], case["vs"], case["tables"][i], s, case["bs"])
        if fresh is not None:
            k[:, s - (b - a):] = fresh[0][a:b].transpose(0, 1).double()
            v[:, s - (b - a):] = fresh[1][a:b].transpose(0, 1).double()
        group = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = (q[a:b].transpose(0, 1) @ k.transpose(1, 2)) * scale  # [H, T, S]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        qpos = torch.arange(s - (b - a), s, device=q.device)[:, None]
        kpos = torch.arange(s, device=q.device)[None, :]
        seen = kpos <= qpos
        if window:
            seen &= kpos > qpos - window
        out[a:b] = (scores.masked_fill(~seen, -math.inf).softmax(-1) @ v).transpose(0, 1)
    return out


def run(case, *, decode, splits=1, window=0, softcap=0.0, fresh=None, launch=None, join=False):
    """The kernel on `case` (with the tiles `launch`, default the kernel's); its output (poisoned
    with NaN before, so every row must be written). `join`: split decodes are joined in the same
    launch, over tickets (which must come back as zeros), else by the second launch."""
    q, d = case["q"], case["d"]
    dev = q.device
    out = torch.full_like(q, float("nan"))
    seq_lens = torch.tensor(case["seq_lens"], dtype=torch.int32, device=dev)
    qsl = torch.tensor(case["qsl"], dtype=torch.int32, device=dev)
    n = len(case["seq_lens"])
    extra = {}
    if case["ks"] is not None:
        extra = {"k_scales": case["ks"], "v_scales": case["vs"]}
    if fresh is not None:
        extra.update(k_new=fresh[0], v_new=fresh[1])
    if decode:
        partials = torch.full((n * q.shape[1] * splits * (d + 2),), float("nan"), device=dev)
        tickets = torch.zeros(n * case["k"].shape[0], dtype=torch.int32, device=dev) if join else None
        paged_attention(q, case["k"], case["v"], case["tables"], seq_lens, qsl, d ** -0.5, out=out, decode=True,
                        num_seqs=n, splits=splits, partials=partials, window=window, softcap=softcap, launch=launch,
                        tickets=tickets, **extra)
        if join:
            assert not tickets.any(), tickets  # (left as found, for the next launch)
    else:
        t = launch or tiling(False, q.shape[1] // case["k"].shape[0], d, q.dtype == torch.float32)
        seqs, firsts = query_tiles(case["qsl"], t.block_q)
        tiles = (torch.tensor(seqs, dtype=torch.int32, device=dev), torch.tensor(firsts, dtype=torch.int32, device=dev))
        paged_attention(q, case["k"], case["v"], case["tables"], seq_lens, qsl, d ** -0.5, out=out, decode=False,
                        num_seqs=n, tiles=tiles, window=window, softcap=softcap, launch=t, **extra)
    return out


def close(out, ref, dtype):
    """float32: to float32 rounding; bf16: the kernel rounds its inputs' products' probabilities
    to bf16 (as FlashAttention) and its output to bf16, and the mean error stays at that scale."""
    err = (out.double() - ref).abs()
    assert not torch.isnan(out).any()
    if dtype == torch.float32:
        assert err.max() < 2e-5, float(err.max())
    else:
        assert err.max() < 3e-2 and err.mean() < 4e-3, (float(err.max()), float(err.mean()))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunks_over_cached_prefixes(device, dtype):
    """Chunks of 1 to 37 queries after 0 to 20 cached keys, three query heads per KV head,
    tiles that split a chunk, shuffled blocks: each query sees exactly its causal prefix."""
    case = make_case((1, 37, 5, 16), (20, 0, 13, 3), dtype=dtype, device=device)
    close(run(case, decode=False), reference(case, case["d"] ** -0.5), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group,d", [(1, 16), (7, 64), (4, 256)])
def test_prefill_head_shapes(device, group, d):
    """GQA groups and head sizes of the catalog's models (SmolLM2 3 per KV head at 64 dims, Qwen2.5
    7 at 64, Gemma 3 4 at 256, plain multi-head at 16)."""
    case = make_case((9, 3), (5, 30), hkv=1, group=group, d=d, device=device)
    close(run(case, decode=False), reference(case, d ** -0.5), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decodes_with_split_keys(device, splits, dtype):
    """Decodes of 1 to 200 keys, each split over `splits` programs whose partial softmaxes are
    joined, by the last split to finish (tickets) or by a second launch, to the same attention; a
    split with no keys (a 1-key sequence) joins as nothing."""
    case = make_case((1, 1, 1, 1), (0, 40, 199, 7), dtype=dtype, device=device)
    ref = reference(case, case["d"] ** -0.5)
    two = run(case, decode=True, splits=splits)
    one = run(case, decode=True, splits=splits, join=True)
    close(two, ref, dtype)
    close(one, ref, dtype)
    close(one, two.double(), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_the_last_split_joins_only_stored_partials_launch_after_launch(device):
    """On a GPU a decode's splits run at once and the last to take its ticket joins them: a join
    that read a partial before its split stored it would read NaN (each launch's partials start
    as NaN) or another launch's. 200 launches of 64 decodes of 2 KV heads x 16 splits (under the
    interpreter, which runs programs one by one: 2 of 3 decodes), each with new queries, all agree
    with the two-launch join."""
    n = 64 if device == "cuda" else 3
    case = make_case((1,) * n, [37 * i % 300 for i in range(n)], hkv=2, group=6, d=128, dtype=torch.bfloat16,
                     device=device)
    g = torch.Generator(device=device).manual_seed(1)
    for _ in range(200 if device == "cuda" else 2):
        case["q"] = torch.randn(case["q"].shape, generator=g, device=device).to(torch.bfloat16)
        close(run(case, decode=True, splits=16, join=True), run(case, decode=True, splits=16).double(),
              torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group,d", [(3, 64), (6, 128), (4, 256)])
def test_every_tiling_computes_the_same_attention(device, group, d):
    """Each tile shape the plan may time and choose (`tilings`: keys per step 16-128, query rows
    32-128) gives the float64 attention in bf16 at the catalog's head shapes (SmolLM2, Qwen2.5-1.5B,
    Gemma 3): decodes of up to 150 keys split over 4 programs, and prefill chunks of up to
    70 queries (tiles that split a chunk, after a cached prefix), a sliding window on one pass."""
    dec = make_case((1, 1, 1), (150, 9, 70), hkv=1, group=group, d=d, bs=16, dtype=torch.bfloat16, device=device)
    pre = make_case((70, 5), (30, 0), hkv=1, group=group, d=d, bs=16, dtype=torch.bfloat16, device=device, seed=2)
    for launch in tilings(True, group, d):
        close(run(dec, decode=True, splits=4, launch=launch, join=True), reference(dec, d ** -0.5), torch.bfloat16)
    close(run(dec, decode=True, splits=4, window=40, launch=tilings(True, group, d)[-1]),
          reference(dec, d ** -0.5, 40), torch.bfloat16)
    for launch in tilings(False, group, d):
        close(run(pre, decode=False, launch=launch), reference(pre, d ** -0.5), torch.bfloat16)
    close(run(pre, decode=False, window=33, launch=tilings(False, group, d)[-1]), reference(pre, d ** -0.5, 33),
          torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_a_padding_row_attends_to_nothing(device):
    """A CUDA graph's padding row (no keys) comes out as zeros, never NaN; the others unchanged."""
    case = make_case((1, 1), (10, 5), device=device)
    case["seq_lens"] = [11, 0]
    ref = reference({**case, "seq_lens": [11], "qsl": [0, 1]}, case["d"] ** -0.5)[:1]
    for splits, join in ((1, False), (2, False), (2, True)):
        out = run(case, decode=True, splits=splits, join=join)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        close(out[:1], ref, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_sliding_window_and_softcap(device):
    """A window of 5 keys (Gemma 3's local layers' rule: key position > query position - 5) in
    prefill and split decodes, and scores soft-capped at 2 (tanh; Gemma 2)."""
    pre = make_case((12, 4), (0, 20), device=device)
    close(run(pre, decode=False, window=5, softcap=2.0), reference(pre, pre["d"] ** -0.5, 5, 2.0), torch.float32)
    dec = make_case((1, 1, 1), (30, 3, 64), device=device)
    for join in (False, True):
        close(run(dec, decode=True, splits=2, window=5, join=join), reference(dec, dec["d"] ** -0.5, 5),
              torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_int8_cache(device, dtype):
    """An int8 cache (codes and a float32 scale per row, read in place; the scales applied to the
    scores and probabilities) equals attention over the dequantized rows, in prefill and decode."""
    pre = make_case((6, 2), (9, 17), int8=True, dtype=dtype, device=device)
    close(run(pre, decode=False), reference(pre, pre["d"] ** -0.5), dtype)
    dec = make_case((1, 1), (9, 17), int8=True, dtype=dtype, device=device)
    close(run(dec, decode=True, splits=2, join=True), reference(dec, dec["d"] ** -0.5), dtype)
    win = make_case((5, 1), (30, 40), int8=True, dtype=dtype, device=device, seed=4)
    close(run(win, decode=False, window=7), reference(win, win["d"] ** -0.5, 7), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_fresh_keys_replace_the_cache_from_the_first_new_token(device):
    """`k_new`/`v_new`: a sliding-window ring is read before the pass writes it, so the chunk's own
    keys come from the pass's rows, the earlier ones from the cache (whose slots for the new
    positions hold stale keys here, which must not be read). The values as a strided view of a
    wider row (a fused q/k/v product's), the keys contiguous: each read with its own strides."""
    case = make_case((7, 3), (11, 4), device=device, seed=3)
    g = torch.Generator().manual_seed(9)
    t, hkv, d = case["q"].shape[0], case["k"].shape[0], case["d"]
    k_new = torch.randn(t, hkv, d, generator=g).to(device)
    v_new = torch.randn(t, 3 * hkv * d, generator=g).to(device)[:, hkv * d : 2 * hkv * d].view(t, hkv, d)
    out = run(case, decode=False, window=6, fresh=(k_new, v_new))
    close(out, reference(case, d ** -0.5, 6, fresh=(k_new, v_new)), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aligned_fresh_keys_do_not_depend_on_where_the_chunk_starts(device, dtype):
    """``aligned`` (the batch-invariant plan's): a sliding-window prompt of 40 tokens, as one chunk
    or as a chunk from position 21 after a cached prefix, gives its last 19 queries the same bits
    (each query's key tiles start at multiples of the tile, the tile holding the first new token
    read from both sources); without it the two differ in their last bits."""
    g = torch.Generator().manual_seed(4)
    hkv, group, d, bs, n, cut, window = 2, 2, 32, 4, 40, 21, 24
    q = torch.randn(n, hkv * group, d, generator=g).to(dtype).to(device)
    k_all, v_all = (torch.randn(n, hkv, d, generator=g).to(dtype).to(device) for _ in range(2))
    k_cache = k_all.view(n // bs, bs, hkv, d).permute(2, 0, 1, 3).contiguous()  # [Hkv, blocks, bs, D], in order
    v_cache = v_all.view(n // bs, bs, hkv, d).permute(2, 0, 1, 3).contiguous()
    table = torch.arange(n // bs, dtype=torch.int32, device=device)[None]
    seq_len = torch.tensor([n], dtype=torch.int32, device=device)
    t = tiling(False, group, d, dtype == torch.float32)

    def chunk(first: int, aligned: bool) -> torch.Tensor:
        rows = n - first
        qsl = torch.tensor([0, rows], dtype=torch.int32, device=device)
        seqs, firsts = query_tiles([0, rows], t.block_q)
        tiles = (torch.tensor(seqs, dtype=torch.int32, device=device), torch.tensor(firsts, dtype=torch.int32,
                                                                                   device=device))
        out = torch.full_like(q[first:], float("nan"))
        paged_attention(q[first:], k_cache, v_cache, table, seq_len, qsl, d ** -0.5, out=out, decode=False,
                        num_seqs=1, tiles=tiles, window=window, k_new=k_all[first:], v_new=v_all[first:],
                        aligned=aligned)
        return out

    whole, late = chunk(0, True), chunk(cut, True)
    assert torch.equal(whole[cut:], late)
    close(late, reference(dict(q=q, k=k_cache, v=v_cache, ks=None, vs=None, tables=table.cpu(), seq_lens=[n],
                               qsl=[0, n], bs=bs, d=d), d ** -0.5, window)[cut:], dtype)
    assert not torch.equal(chunk(0, False)[cut:], chunk(cut, False))


def test_choose_tilings_times_every_tile_on_the_models_shapes_and_keeps_the_fastest(monkeypatch):
    """`choose_tilings` times each decode tiling over 64 sequences of 640 keys and one of 1024
    (their splits as the engine takes them, two layers each) and each prefill tiling over a chunk
    of 2048 queries (its query tiles made with that tiling's block_q): the fastest of each kind is
    chosen, a tiling that raises drops out, and the report has every time. float32 keeps its one
    set, untimed."""
    import nextoken.kernels.gpu.attention as A

    calls = []
    fast_decode, fast_prefill, broken = tilings(True, 3, 64)[2], tilings(False, 3, 64)[1], tilings(False, 3, 64)[3]

    def recorded(q, k_cache, v_cache, tables, seq_lens, qsl, scale, *, out, decode, num_seqs, launch, tiles=None,
                 splits=1, partials=None, tickets=None):
        if launch == broken:
            raise RuntimeError("out of resources")
        assert k_cache.shape[1:] == (tables.numel(), 16, 64) and q.shape[1:] == (6, 64)
        calls.append((decode, launch, num_seqs, q.shape[0], splits, None if tiles is None else tiles[0].numel()))

    monkeypatch.setattr(A, "paged_attention", recorded)

    def timer(fn):
        before = len(calls)
        fn()
        ran = calls[before:]
        assert len({c[1] for c in ran}) == 1  # one tiling a timing
        return 1.0 if ran[0][1] in (fast_decode, fast_prefill) else 2.0

    report = {}
    chosen = A.choose_tilings(6, 2, 64, torch.bfloat16, 16, torch.device("cpu"), timer=timer, report=report)
    assert (chosen.decode, chosen.prefill) == (fast_decode, fast_prefill)
    for t in tilings(True, 3, 64):
        assert [c for c in calls if c[1] == t] == [(True, t, 64, 64, decode_splits(64, 2, 1), None)] * 2 + [
            (True, t, 1, 1, decode_splits(1, 2, 1), None)] * 2
    for t in tilings(False, 3, 64):
        if t != broken:
            assert [c for c in calls if c[1] == t] == [(False, t, 1, 2048, 1, -(-2048 // t.block_q))] * 2
    assert set(report["decode"]) == {str(t) for t in tilings(True, 3, 64)}
    assert set(report["prefill"]) == {str(t) for t in tilings(False, 3, 64) if t != broken}
    assert chosen.join_splits == A.SPLIT_CHOICES[-1] and report["join"] == {}  # (one split here: nothing joined)
    calls.clear()
    assert A.choose_tilings(6, 2, 64, torch.float32, 16, torch.device("cpu"), timer=timer) == A.default_tilings(
        3, 64, True) and not calls
    # with a GPU's splits (4 for the 64 decodes, 16 for the one), the chosen tiles' join is timed both ways
    monkeypatch.setattr(A, "decode_splits", lambda seqs, hkv, sms: 4 if seqs == 64 else 16)
    joins = []

    def joined(*args, tickets=None, **kwargs):
        joins.append((kwargs.get("splits", 1), tickets is not None))
        return recorded(*args, tickets=tickets, **kwargs)

    monkeypatch.setattr(A, "paged_attention", joined)

    def join_timer(fn):  # (the 16 splits' join in the launch slower, every other timing equal)
        before = len(joins)
        fn()
        ran = set(joins[before:])
        return 3.0 if ran == {(16, True)} else 1.0

    report = {}
    chosen = A.choose_tilings(6, 2, 64, torch.bfloat16, 16, torch.device("cpu"), timer=join_timer, report=report)
    assert chosen.join and chosen.join_splits == 4 and chosen.joins(4) and not chosen.joins(16)
    assert set(report["join"]) == {"4 splits", "16 splits"} and report["join"]["16 splits"]["own launch"] == 3.0


def test_the_plan_takes_timed_tiles_on_a_gpu_with_graphs_alone(tiny_gguf, monkeypatch):
    """The plan's `choose_tilings`: on a GPU (a stand-in device here) in bf16 with CUDA graphs it
    takes `attention.choose_tilings`' tiles (a stand-in: its timing needs CUDA) and shows them
    on its line; the defaults under ``enforce_eager``, in float32 and off a GPU, untimed; and
    the defaults, with the reason on its line, when the timing raises."""
    import dataclasses

    import nextoken.kernels.gpu.attention as A
    from nextoken.loader.source import open_model
    from nextoken.runner.device import Device, resolve_device
    from nextoken.runner.model_runner import ModelRunner

    runner = ModelRunner(open_model(str(tiny_gguf["llama"][0])), torch.bfloat16, enforce_eager=True,
                         attention_backend="triton", device=resolve_device(DEVICES[0]))  # (compiled: on the GPU)
    cfg, default = runner.model.config, runner.tilings
    group = cfg.num_heads // cfg.num_kv_heads
    timed = A.Tilings(tilings(True, group, cfg.head_dim)[1], tilings(False, group, cfg.head_dim)[2])
    asked = []

    def stand_in(*args, report=None):
        asked.append(args)
        report.update({"decode": {str(timed.decode): 1e-5}})
        return timed

    monkeypatch.setattr(A, "choose_tilings", stand_in)
    gpu = Device(torch.device("cuda"), "a GPU", "asked for")
    plan = dataclasses.replace(runner.plan, device=gpu, cuda_graphs=True, tiling_times={})
    assert plan.choose_tilings(cfg, 16, default) == timed and plan.tilings == timed and plan.tiling_times
    assert asked == [(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, 16, gpu.torch)]
    assert f"tiles: decodes {timed.decode}, prefill {timed.prefill}, as timed on this GPU)" in plan.describe(runner.model)
    plan.tilings = dataclasses.replace(timed, join=False)  # (the joined splits differed there: two launches, said)
    assert "as timed on this GPU; key splits joined in a second launch: joined in the attention's own, their values " \
        "differed here" in plan.describe(runner.model)
    plan.tilings = dataclasses.replace(timed, join_splits=4)  # (timed slower at more splits: said)
    assert "key splits joined in the attention's launch up to 4, in a second launch past that (as timed)" in \
        plan.describe(runner.model)
    plan.tilings = dataclasses.replace(timed, join_splits=0)
    assert "key splits joined in a second launch (as timed: the attention's own was slower)" in \
        plan.describe(runner.model)
    for other in (dataclasses.replace(runner.plan, device=gpu, cuda_graphs=False),  # enforce_eager
                  dataclasses.replace(runner.plan, device=gpu, cuda_graphs=True, dtype=torch.float32),
                  runner.plan):  # (the CPU's)
        assert other.choose_tilings(cfg, 16, default) is default and other.tilings is None
    assert len(asked) == 1

    def broken(*args, report=None):
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(A, "choose_tilings", broken)
    plan = dataclasses.replace(runner.plan, device=gpu, cuda_graphs=True, reasons={})
    assert plan.choose_tilings(cfg, 16, default) is default
    assert "attention tiles off: RuntimeError: out of resources" in plan.describe(runner.model)


def test_query_tiles_and_splits():
    """Tiles cover every query once; splits fill two programs per multiprocessor, a power of two."""
    seqs, firsts = query_tiles([0, 1, 1, 40, 45], 16, first=1)
    assert list(zip(seqs, firsts)) == [(2, 0), (2, 16), (2, 32), (3, 0)]
    assert decode_splits(1, 2, 132) == 16 and decode_splits(64, 2, 132) == 4 and decode_splits(256, 8, 132) == 1
    assert decode_splits(16, 2, 132) == 16 and decode_splits(1, 1, 1) == 4
    assert tiling(True, 7, 64).block_m == 16 and tiling(False, 6, 128).block_q == 21
    assert all(t.block_m >= 16 and t.block_q * 6 <= t.block_m for t in tilings(False, 6, 128) + tilings(True, 6, 128))
    assert tiling(False, 4, 256).block_q == 8 and tiling(False, 6, 128, f32=True).block_q == 2


def test_choose_join_keeps_the_join_in_the_launch_up_to_the_splits_where_it_times_no_slower():
    """`choose_join` times each split count's decodes with their splits joined in their own launch
    and in a second one (runs of one count together; a count of 1 has no join, untimed): the join
    stays up to the last count where it was no slower, every count when none was slower, none
    when the fewest splits' was; `Tilings.joins` follows that, and `join` (the values' check)
    overrides it."""
    import nextoken.kernels.gpu.attention as A

    ran = []

    def runs(splits, n=1):
        return [(splits, lambda t, join, s=splits, i=i: ran.append((s, i, join, t))) for i in range(n)]

    def timer_with(slower):  # (the counts whose join in the launch is slower)
        def timer(fn):
            before = len(ran)
            fn()
            (splits, join), = {(s, j) for s, _, j, _ in ran[before:]}  # (one count, one way a timing)
            return (2.0 if splits in slower else 1.0) if join else 1.5
        return timer

    tile = tilings(True, 3, 64)[1]
    most, times = A.choose_join(runs(4) + runs(16), tile, timer_with(set()))
    assert most == A.SPLIT_CHOICES[-1] and times == {"4 splits": {"own launch": 1.0, "second launch": 1.5},
                                                     "16 splits": {"own launch": 1.0, "second launch": 1.5}}
    assert sorted(ran) == sorted([(4, 0, True, tile), (4, 0, False, tile), (16, 0, True, tile),
                                  (16, 0, False, tile)])
    assert A.choose_join(runs(4) + runs(16), tile, timer_with({16}))[0] == 4
    assert A.choose_join(runs(4) + runs(16), tile, timer_with({4}))[0] == 0
    ran.clear()
    assert A.choose_join(runs(16, 2), tile, timer_with({16}))[0] == 0 and len(ran) == 4  # (both runs, each way)
    assert A.choose_join(runs(1), tile, timer_with({1})) == (A.SPLIT_CHOICES[-1], {})
    timed = A.Tilings(tile, tilings(False, 3, 64)[0], True, 4)
    assert timed.joins(4) and not timed.joins(16) and not A.Tilings(tile, tile, False, 16).joins(4)


def test_a_join_that_differs_from_two_launches_is_turned_off():
    """`joins_as_two_launches` runs decodes with their splits joined in their own launch and in a
    second one, several times: here (the interpreter) the real kernel agrees; a join that read a
    partial too early (NaN, or another launch's values) does not, and the plan's timing then
    keeps two launches (`Tilings.join`)."""
    import nextoken.kernels.gpu.attention as A

    case = make_case((1, 1, 1), (150, 9, 70), hkv=1, group=3, d=64, bs=16, dtype=torch.bfloat16,
                     device=DEVICES[0])

    def real(t, join):
        return run(case, decode=True, splits=4, launch=t, join=join)

    tiling = tilings(True, 3, 64)[0]
    assert A.joins_as_two_launches([real], tiling, times=1)
    for wrong in (float("nan"), 1.0):
        def racy(t, join, wrong=wrong):
            out = real(t, join)
            return out.index_fill(1, torch.tensor([0], device=out.device), wrong) if join else out

        assert not A.joins_as_two_launches([real, racy], tiling, times=1)
