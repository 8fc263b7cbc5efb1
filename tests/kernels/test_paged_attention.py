"""Paged attention: the fast path against the reference, and the reference against plain
attention over contiguous keys (so the block gather itself is checked)."""

from __future__ import annotations

import pytest
import torch

from nextoken.kernels import KernelSet, load
from nextoken.layers.attention import PREFILL_BLOCK, AttentionMetadata, causal_mask, naive_attention, \
    native_decode_attention, paged_attention, paged_attention_reference, prefill_attention

H, HKV, D, BS, NB = 4, 2, 16, 4, 1000
SCORES = KernelSet.resolve().prefill_scores  # None without AVX512-BF16: then both runs are PyTorch's


def build_batch(specs, seed=0, dtype=torch.float32, H=H, HKV=HKV, D=D, BS=BS, NB=NB):
    """specs: (cached tokens, new tokens) per sequence, decodes first. Returns q, caches, meta
    and each sequence's contiguous k, v (all its tokens) for the independent check."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(HKV, NB, BS, D, dtype=dtype)
    v_cache = torch.zeros(HKV, NB, BS, D, dtype=dtype)
    free = torch.randperm(NB, generator=g).tolist()  # blocks in a scrambled order
    qs, slots, qsl, seq_lens, tables, contiguous = [], [], [0], [], [], []
    for cached, new in specs:
        total = cached + new
        blocks = [free.pop() for _ in range(-(-total // BS))]
        k = torch.randn(HKV, total, D, generator=g).to(dtype)
        v = torch.randn(HKV, total, D, generator=g).to(dtype)
        for p in range(total):  # every token's key/value at its slot
            k_cache[:, blocks[p // BS], p % BS] = k[:, p]
            v_cache[:, blocks[p // BS], p % BS] = v[:, p]
        qs.append(torch.randn(new, H, D, generator=g).to(dtype))
        slots += [blocks[p // BS] * BS + p % BS for p in range(cached, total)]
        qsl.append(qsl[-1] + new)
        seq_lens.append(total)
        tables.append(blocks)
        contiguous.append((k, v))
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    meta = AttentionMetadata(torch.tensor(slots), qsl, seq_lens, bt, sum(1 for _, n in specs if n == 1), BS)
    return torch.cat(qs), k_cache, v_cache, meta, contiguous


SPECS = [
    [(n % 23 * 3, 1) for n in range(40)] + [(5, 3)],  # more decodes than one chunk, many lengths
    [(0, 7)],  # one whole prompt
    [(9, 1)],  # one decode
    [(3, 1), (17, 1), (0, 1), (0, 9), (6, 5)],  # decodes of several lengths, a prompt, a chunk after cache
    [(31, 1), (1, 1), (8, 12), (0, 2)],
    [(2, 1), (0, 300), (150, 200)],  # prefill chunks of several blocks of prefill_attention
]


@pytest.fixture(params=["native", "torch"])
def decode_kernel(request):
    """Run a test with our C decode kernel, then with the PyTorch decode paths: a function that
    sets a batch's metadata to that backend, as the execution plan does."""
    kernels = KernelSet()
    if request.param == "native":
        kernels = KernelSet.resolve()
        assert kernels.paged_attention is not None, "the C kernel did not build (is gcc installed?)"

    def configure(meta: AttentionMetadata) -> AttentionMetadata:
        meta.backend, meta.kernels = request.param, kernels
        return meta
    return configure


@pytest.mark.parametrize("specs", SPECS)
def test_fast_path_equals_reference(specs, decode_kernel):
    q, kc, vc, meta, _ = build_batch(specs)
    decode_kernel(meta)
    ref = paged_attention_reference(q, kc, vc, meta, 0.25)
    assert torch.allclose(paged_attention(q, kc, vc, meta, 0.25), ref, atol=1e-5)


def test_lone_decode_over_consecutive_blocks_reads_a_view(decode_kernel):
    """One sequence whose blocks are consecutive: the PyTorch path attends over a view of the
    cache (meta.first_block) instead of gathering; same result as the reference."""
    g = torch.Generator().manual_seed(5)
    kc, vc = torch.randn(HKV, NB, BS, D, generator=g), torch.randn(HKV, NB, BS, D, generator=g)
    seq_len, first = 4 * BS + 3, 17
    table = torch.arange(first, first + 5)[None]
    meta = decode_kernel(AttentionMetadata(torch.tensor([first * BS + seq_len - 1]), [0, 1], [seq_len], table, 1, BS,
                                           first_block=[first]))
    q = torch.randn(1, H, D, generator=g)
    ref = paged_attention_reference(q, kc, vc, meta, 0.25)
    assert torch.allclose(paged_attention(q, kc, vc, meta, 0.25), ref, atol=1e-5)


def test_layout_marks_exactly_the_sequences_whose_blocks_are_consecutive():
    """`runner.inputs.layout`'s `first_block` (one pass over the block tables) against the rule
    stated per sequence: consecutive ascending ids give the first; a permutation of a run, a gap,
    a repeat or a run under a longer row's padding give None."""
    import random

    from nextoken.runner.inputs import layout
    from nextoken.runner.model_runner import SequenceInput

    rng = random.Random(3)
    tables = [[7], [4, 5, 6, 7], [9, 8, 10], [3, 5, 6], [2, 2, 3], [11, 12], list(range(40, 90)), [0, 1, 2]]
    tables += [rng.sample(range(500), rng.randint(1, 30)) for _ in range(20)]
    tables += [list(range(s, s + rng.randint(1, 30))) for s in rng.sample(range(500), 20)]
    seqs = [SequenceInput([1], len(b) * BS - 1, b, True) for b in tables]
    batch = layout(seqs, BS)
    want = [b[0] if all(y == b[0] + i for i, y in enumerate(b)) else None for b in tables]
    assert [batch.first_block[batch.order.index(i)] for i in range(len(tables))] == want
    assert sum(w is not None for w in want) >= 24


def test_a_small_decode_steps_layout_equals_the_general_one(monkeypatch):
    """`layout` of a decode step of at most `SMALL_DECODE` sequences (plain Python) against the
    general NumPy layout of the same step: every field of the `HostBatch`, with fed tokens and
    with a sliding-window ring; a sequence its blocks cannot hold is refused alike."""
    import random
    from dataclasses import astuple
    from types import SimpleNamespace

    from nextoken.errors import EngineError

    from nextoken.runner import inputs
    from nextoken.runner.model_runner import SequenceInput

    def fields(batch) -> dict:
        out = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in vars(batch).items() if k != "sliding"}
        sm = batch.sliding
        out["sliding"] = None if sm is None else [v.tolist() if hasattr(v, "tolist") else
                                                  [getattr(x, "tolist", lambda: x)() for x in v]
                                                  if isinstance(v, list) else v for v in astuple(sm)]
        return out

    rng = random.Random(11)
    ring = SimpleNamespace(window=2 * BS, ring_blocks=3)  # (what `layout` reads of a `SlidingKVCache`)
    for trial in range(60):
        seqs = []
        for _ in range(rng.randint(1, inputs.SMALL_DECODE)):
            n = rng.randint(1, 9)
            blocks = list(range(b := rng.randrange(100), b + n)) if rng.random() < 0.5 else rng.sample(range(100), n)
            start = rng.randint(max(0, (n - 1) * BS - 1), n * BS - 1)  # (at block boundaries too)
            seqs.append(SequenceInput([rng.randrange(1000)], start, blocks, True, fed_from=rng.choice([-1, len(seqs)]),
                                      ring_ids=rng.sample(range(100, 200), 3), off_ring={}))
        sliding, fed = (ring if trial % 3 == 0 else None), trial % 2 == 0
        small = inputs.layout(seqs, BS, sliding, fed)
        with monkeypatch.context() as m:
            m.setattr(inputs, "SMALL_DECODE", 0)
            general = inputs.layout(seqs, BS, sliding, fed)
        assert fields(small) == fields(general), trial
    too_long = [SequenceInput([1], 2 * BS, [4, 5], True)]  # (its token needs a third block)
    for limit in (inputs.SMALL_DECODE, 0):
        monkeypatch.setattr(inputs, "SMALL_DECODE", limit)
        with pytest.raises(EngineError, match="has 2 blocks"):
            inputs.layout(too_long, BS)


def test_staged_arrays_start_16_byte_aligned():
    """`Staging` packs a step's arrays into one buffer per dtype at 16-byte aligned starts
    (`packed_offsets`), so that a kernel's pointer into any of them has one alignment, and one
    compilation, whatever the sizes before it: int32 starts are multiples of 4 elements, int64
    of 2, and no array overlaps the next."""
    from nextoken.runner.inputs import packed_offsets

    assert packed_offsets([3, 5, 1, 16, 0, 2], 4) == ([0, 4, 12, 16, 32, 32], 34)
    assert packed_offsets([3, 1, 6], 8) == ([0, 4, 6], 12)
    assert packed_offsets([], 4) == ([], 0)
    sizes = [7, 1, 130, 3]
    offsets, total = packed_offsets(sizes, 4)
    assert all(o * 4 % 16 == 0 for o in offsets) and total >= sum(sizes)
    assert all(a + n <= b for a, n, b in zip(offsets, sizes, offsets[1:] + [total]))


@pytest.mark.parametrize("specs", SPECS)
def test_reference_equals_attention_over_contiguous_keys(specs):
    q, kc, vc, meta, contiguous = build_batch(specs, seed=1)
    probs = []
    out = paged_attention_reference(q, kc, vc, meta, 0.25, sink=probs)
    for i, (k, v) in enumerate(contiguous):
        a, b = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        expected, _ = naive_attention(q[a:b], k, v, 0.25)
        assert torch.allclose(out[a:b], expected, atol=1e-6)
        # causality: new token j (position seq_len - q_len + j) puts no weight on later positions
        start = meta.seq_lens[i] - (b - a)
        for j in range(b - a):
            assert probs[i][:, j, start + j + 1 :].abs().sum() == 0


@pytest.mark.parametrize("specs", [SPECS[0], SPECS[2], SPECS[3], SPECS[5]])
def test_bfloat16_fast_path_close_to_reference(specs, decode_kernel):
    q, kc, vc, meta, _ = build_batch(specs, seed=2, dtype=torch.bfloat16)
    decode_kernel(meta)
    ref = paged_attention_reference(q, kc, vc, meta, 0.25)
    assert (paged_attention(q, kc, vc, meta, 0.25).float() - ref.float()).abs().max() < 0.05


@pytest.mark.parametrize("heads,kv_heads,dim,block", [(9, 3, 64, 16), (12, 2, 128, 16), (4, 2, 64, 6), (8, 8, 96, 16), (4, 4, 80, 16)])
def test_native_decode_on_model_shapes(heads, kv_heads, dim, block):
    """The C kernel on the head shapes of real models (SmolLM2 9/3 x 64, Qwen2.5-1.5B 12/2 x 128:
    its AVX-512 path, keys four at a time), with sequences longer than one split-K chunk (256
    keys), lengths that are not a multiple of four or of the block, a block size of 6 (the
    one-key tail), a head size whose p v has no register-resident form (96) and one that is
    not a multiple of 32 (80: the plain C loops): bf16, against the float32 reference of the
    same bf16 inputs."""
    from nextoken import kernels

    assert kernels.load("paged_attention") is not None, "the C kernel did not build (is gcc installed?)"
    specs = [(700, 1), (0, 1), (255, 1), (256, 1), (1030, 1), (37, 1)]
    q, kc, vc, meta, _ = build_batch(specs, seed=3, dtype=torch.bfloat16, H=heads, HKV=kv_heads, D=dim, BS=block,
                                     NB=400)
    ref = paged_attention_reference(q.float(), kc.float(), vc.float(), meta, dim ** -0.5)
    out = native_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, dim ** -0.5,
                                  lib=load("paged_attention"))
    assert out is not None
    err = (out.float() - ref).abs()
    assert err.max() < 2e-2 and err.mean() < 2e-3  # bf16 output rounding: 2^-9 of values about 1
    # and no error of its own beyond that rounding (float32 arithmetic throughout; rounding p to one
    # bf16 in p v would add about 15% at a few hundred keys)
    assert err.mean() <= 1.03 * (ref.bfloat16().float() - ref).abs().mean()


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (12, 2)])
@pytest.mark.parametrize("cached,new", [(0, 1), (0, PREFILL_BLOCK - 1), (0, PREFILL_BLOCK), (0, PREFILL_BLOCK + 1),
                                        (37, 300), (500, 3)])
@pytest.mark.parametrize("bf16_matmul", [True, False])
def test_prefill_attention_equals_naive(heads, kv_heads, cached, new, bf16_matmul, monkeypatch):
    """The blocked prefill attention (GQA groups stacked, masked half skipped) against the
    float32 reference: float32 to 1e-5; bf16 within bf16's rounding of the probabilities, with
    ``p v`` in bf16 or (a CPU whose bf16 matmul does not pay: `kernels.bf16_matmul_native`) in
    float32, the scores kernel's bf16 probabilities included."""
    import nextoken.layers.attention as attention

    monkeypatch.setattr(attention, "bf16_matmul_native", lambda: bf16_matmul)
    g = torch.Generator().manual_seed(cached + new + heads)
    total = cached + new
    q = torch.randn(new, heads, 32, generator=g)
    k, v = torch.randn(kv_heads, total, 32, generator=g), torch.randn(kv_heads, total, 32, generator=g)
    expected, _ = naive_attention(q, k, v, 0.3)
    assert torch.allclose(prefill_attention(q, k, v, 0.3), expected, atol=1e-5)
    bf = prefill_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.3)
    ref_bf, _ = naive_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.3)
    assert bf.dtype == torch.bfloat16
    assert (bf.float() - ref_bf.float()).abs().max() < 0.03
    native = prefill_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.3, kernel=SCORES)
    assert (native.float() - ref_bf.float()).abs().max() < 0.03


def test_prefill_blocks_capped_by_the_scores_budget(monkeypatch):
    """After many keys the blocks shrink to keep their scores within `SCORES_BUDGET` (here made
    small: blocks of 20, 20 and 10 rows), and the scratch buffers, reused from a larger call and
    poisoned with NaN, hold no stale values: both paths still equal the float32 reference."""
    import nextoken.layers.attention as attention

    heads, kv_heads, cached, new = 6, 2, 250, 50
    monkeypatch.setattr(attention, "SCORES_BUDGET", 4 * heads * (cached + new) * 20)
    assert attention.prefill_block_rows(heads, cached + new) == 20
    g = torch.Generator().manual_seed(11)
    big = [torch.randn(kv_heads, 700, 32, generator=g).bfloat16() for _ in range(2)]
    prefill_attention(torch.randn(40, heads, 32, generator=g).bfloat16(), *big, 0.3, kernel=SCORES)  # grows scratch
    for buf in attention._scratch.buffers.values():  # a value left unwritten would show as NaN
        buf.fill_(float("nan"))
    q = torch.randn(new, heads, 32, generator=g)
    k, v = torch.randn(kv_heads, cached + new, 32, generator=g), torch.randn(kv_heads, cached + new, 32, generator=g)
    expected, _ = naive_attention(q, k, v, 0.3)
    assert torch.allclose(prefill_attention(q, k, v, 0.3), expected, atol=1e-5)
    ref_bf, _ = naive_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.3)
    native = prefill_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.3, kernel=SCORES)
    assert (native.float() - ref_bf.float()).abs().max() < 0.03


@pytest.mark.parametrize("kv_heads,rows,keys,total,dim", [(3, 384, 4608, 4608, 64), (2, 7, 300, 301, 128),
                                                          (1, 13, 65, 70, 34), (2, 1, 1, 1, 32)])
def test_native_prefill_scores_equal_float32_matmul(kv_heads, rows, keys, total, dim):
    """``kernels/prefill_scores.c`` (exact bf16 products, float32 sums) against PyTorch's float32
    bmm of the same bf16 values: row and key counts that fill no tile (6 rows, 64 keys), fewer
    keys than the cache holds, a head size that is not a multiple of 16."""
    from nextoken.layers.attention import _native_scores, _packed_keys
    from tests.helpers.cpu import cpu_has

    if not cpu_has("avx512_bf16"):
        pytest.skip("this CPU has no AVX512-BF16: prefill_attention keeps its float32 bmm (tested above)")
    g = torch.Generator().manual_seed(rows + keys)
    k = torch.randn(kv_heads, total, dim, generator=g).bfloat16()
    q = torch.randn(kv_heads, rows, dim, generator=g).bfloat16()
    assert SCORES is not None, "the prefill scores kernel did not build (is gcc installed?)"
    packed = _packed_keys(k, SCORES)
    out = _native_scores(SCORES, q, packed, total, keys, 0.3)
    expected = torch.bmm(q.float(), k[:, :keys].float().transpose(1, 2)) * 0.3
    assert out.shape == expected.shape and torch.allclose(out, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shift", [0.0, -400.0, 400.0])
@pytest.mark.parametrize("kv_heads,group,n,keys", [(2, 6, 128, 4608), (3, 3, 7, 300), (1, 1, 1, 1), (2, 2, 5, 5)])
def test_native_prefill_softmax_equals_pytorch(kv_heads, group, n, keys, shift):
    """``prefill_softmax`` (causal mask, float32 softmax, bf16 probabilities) against PyTorch's
    masked softmax rounded to bf16: the same up to one bf16 rounding step of float32 noise, zeros
    exactly where the mask hides a key; scores spread over +-30 so some exps underflow, and
    shifted far below or above zero (Qwen2.5-1.5B's first query of a prompt scores about -400:
    a row's maximum must come from its visible keys alone). Shapes: Qwen2.5-1.5B's block after
    4480 keys, row counts that fill no vector, one key, a square."""
    from nextoken.layers.attention import _native_softmax
    from tests.helpers.cpu import cpu_has

    if not cpu_has("avx512_bf16"):
        pytest.skip("this CPU has no AVX512-BF16: prefill_attention keeps PyTorch's softmax (tested above)")
    g = torch.Generator().manual_seed(keys + n)
    scores = torch.randn(kv_heads, group, n, keys, generator=g) * 10
    scores[..., : keys // 3] *= 3
    scores += shift
    ref = scores.clone()
    ref[..., keys - n :].masked_fill_(~causal_mask(n, n), float("-inf"))
    ref = ref.softmax(-1).to(torch.bfloat16).float().view(kv_heads, group * n, keys)
    assert SCORES is not None, "the prefill scores kernel did not build (is gcc installed?)"
    out = _native_softmax(SCORES, scores.view(kv_heads, group * n, keys).contiguous(), group, n).float()
    hidden = torch.arange(keys)[None, :] > torch.arange(keys - n, keys)[:, None]  # [n, keys]
    assert (out.view(kv_heads, group, n, keys)[..., hidden] == 0).all()
    assert torch.allclose(out, ref, rtol=2 ** -8, atol=1e-30)
    assert torch.allclose(out.sum(-1), torch.ones(kv_heads, group * n), atol=2e-2)


def int8_caches(kc, vc, dtype):
    """Quantize whole caches ``[Hkv, NB, BS, D]`` row by row (what `PagedKVCache.write` stores)."""
    from nextoken.kv_cache.tensors import Int8Rows, quantize_rows

    return Int8Rows(*quantize_rows(kc), dtype), Int8Rows(*quantize_rows(vc), dtype)


@pytest.mark.parametrize("heads,kv_heads,dim,block", [(9, 3, 64, 16), (12, 2, 128, 16), (4, 2, 64, 6), (8, 8, 80, 16),
                                                      (4, 4, 24, 16)])
@pytest.mark.parametrize("portable", [False, True])
def test_native_int8_decode_equals_reference(heads, kv_heads, dim, block, portable):
    """The C kernel over an int8 cache (codes and row scales read in place) against the float32
    reference over the same rows dequantized: model head shapes (SmolLM2, Qwen2.5-1.5B), block
    size 6 (chunks that start mid-block: groups of fewer than four keys between full ones),
    D = 80 (AVX-512 p v accumulating in memory), D = 24 (the plain C loops), and the portable
    build (plain C loops for every shape)."""
    from nextoken.kv_cache.tensors import Int8Rows

    specs = [(700, 1), (0, 1), (255, 1), (256, 1), (1030, 1), (37, 1)]
    q, kc, vc, meta, _ = build_batch(specs, seed=4, dtype=torch.bfloat16, H=heads, HKV=kv_heads, D=dim, BS=block,
                                     NB=400)
    k8, v8 = int8_caches(kc, vc, torch.bfloat16)
    ref = paged_attention_reference(q.float(), Int8Rows(*k8[:2], torch.float32), Int8Rows(*v8[:2], torch.float32),
                                       meta, dim ** -0.5)
    out = native_decode_attention(q, k8, v8, meta.block_tables, meta.seq_lens, dim ** -0.5,
                                  lib=load("paged_attention", portable))
    assert out is not None, "the C kernel did not build (is gcc installed?)"
    err = (out.float() - ref).abs()
    assert err.max() < 2e-2 and err.mean() < 2e-3  # bf16 output rounding


@pytest.mark.parametrize("specs", [SPECS[0], SPECS[3], SPECS[5]])
def test_int8_fast_path_close_to_reference(specs, decode_kernel):
    """Decodes and prefill chunks over an int8 cache (the PyTorch paths dequantize the gathered
    blocks) against the reference over the same codes."""
    q, kc, vc, meta, _ = build_batch(specs, seed=5, dtype=torch.bfloat16)
    k8, v8 = int8_caches(kc, vc, torch.bfloat16)
    ref = paged_attention_reference(q, k8, v8, meta, 0.25)
    assert (paged_attention(q, k8, v8, meta, 0.25).float() - ref.float()).abs().max() < 0.05


def test_int8_rows_accuracy():
    """What the int8 cache costs: each value within half a step (scale / 2) of the original,
    the row's largest magnitude exact; attention over Gaussian keys and values within 1% of
    the float32 result."""
    from nextoken.kv_cache.tensors import dequantize_rows, quantize_rows

    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 50, 64, generator=g) * torch.rand(3, 50, 1, generator=g) * 10
    codes, scales = quantize_rows(x)
    back = dequantize_rows(codes, scales, torch.float32)
    assert ((back - x).abs() <= scales[..., None] / 2 * (1 + 1e-5)).all()
    assert torch.allclose(back.abs().amax(-1), x.abs().amax(-1), rtol=1e-6)
    assert codes.abs().amax(-1).eq(127).all()
    q, kc, vc, meta, _ = build_batch([(300, 1), (40, 1), (0, 20)], seed=7, D=64)
    k8, v8 = int8_caches(kc, vc, torch.float32)
    exact = paged_attention_reference(q, kc, vc, meta, 0.125)
    approx = paged_attention_reference(q, k8, v8, meta, 0.125)
    assert (approx - exact).abs().max() < 0.01 * exact.abs().max()


@pytest.mark.parametrize("dim,block", [(64, 64), (128, 128), (256, 256), (80, 16), (24, 8)])
def test_key_rotation_is_sylvesters_hadamard(dim, block):
    """The int8 cache's key rotation (`hadamard_matrix`) against SciPy's Sylvester Hadamard
    matrix: block diagonal, blocks of the largest power of two dividing D, each ``H / sqrt(b)``;
    symmetric and orthogonal (its own inverse)."""
    from scipy.linalg import hadamard

    from nextoken.kv_cache.tensors import hadamard_matrix

    h = hadamard_matrix(dim)
    want = torch.block_diag(*[torch.tensor(hadamard(block), dtype=torch.float64) / block ** 0.5] * (dim // block))
    assert h.dtype == torch.float32 and torch.equal(h, want.float())
    assert torch.equal(h, h.T)
    assert torch.allclose(h.double() @ h.double(), torch.eye(dim, dtype=torch.float64), atol=1e-6)


def test_rotated_int8_keys_keep_the_scores_of_outlier_channels():
    """Keys with a few channels far larger than the rest (Qwen 2.5's: about 150 against a few
    units) and queries large in the same channels: attention over the int8 cache (the whole
    path, `PagedKVCache.write` and `attend`) against float32 attention over the exact keys. One
    absmax scale per unrotated row leaves the small channels a few codes, and the large query
    channels multiply their errors; rotated, the error of the output is three times smaller, and
    the probabilities stay within a few percent."""
    from nextoken.config import ModelConfig
    from nextoken.kv_cache.tensors import PagedKVCache, dequantize_rows, quantize_rows
    from nextoken.layers.attention import attend

    heads, kv_heads, dim, bs, n = 4, 2, 64, 16, 96
    cfg = ModelConfig("llama", "t", 10, 256, 512, 1, heads, kv_heads, dim, 512, 1e-6, 1e4, dim, False)
    g = torch.Generator().manual_seed(11)
    big = torch.ones(dim)
    big[[3, 35]] = torch.tensor([40.0, 25.0])  # two outlier channels, in the keys and the queries
    k = torch.randn(n, kv_heads, dim, generator=g) * 2 + torch.randn(n, kv_heads, 1, generator=g) * big
    k[:, :, [3, 35]] += torch.tensor([140.0, -90.0])
    v = torch.randn(n, kv_heads, dim, generator=g)
    q = torch.randn(n, heads, dim, generator=g) * big / 8
    meta = AttentionMetadata(torch.arange(n), [0, n], [n], torch.arange(n // bs)[None], 0, bs, backend="reference")
    scale = dim ** -0.5
    exact, exact_probs = naive_attention(q, k.transpose(0, 1), v.transpose(0, 1), scale)
    kv = PagedKVCache(cfg, n // bs, bs, torch.float32, cache_dtype="int8")
    meta.probs = []
    got = attend(q, k, v, kv, 0, meta, scale)
    assert kv.k.dtype == torch.int8 and kv.rotation is not None
    unrotated = naive_attention(q, dequantize_rows(*quantize_rows(k), torch.float32).transpose(0, 1),
                                dequantize_rows(*quantize_rows(v), torch.float32).transpose(0, 1), scale)[0]
    err, err_plain = (got - exact).abs().max(), (unrotated - exact).abs().max()
    # measured: 0.16 against 0.51 unrotated; probabilities 0.048 off at most, 0.154 unrotated
    assert err < err_plain / 2.5, (float(err), float(err_plain))
    assert (meta.probs[0] - exact_probs).abs().max() < 0.07
