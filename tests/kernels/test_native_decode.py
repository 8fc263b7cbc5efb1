"""The one-call C decode (`nextoken.layers.native_decode`, ``kernels/decode.c``) against the
model's PyTorch layers on the same codes, and against the float32 model it came from."""

from __future__ import annotations

import contextlib

import pytest
import torch

from nextoken.loader.gguf import GGUFFile
from nextoken.runner.model_runner import ModelRunner, SequenceInput
from tests.tiny_models import OneSequence, tiny_hf_model, write_gguf

QUANT8 = {name: "Q8_0" for name in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                                       "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")}
QUANT = {"attn_q.weight": "Q4_0", "attn_k.weight": "Q4_1", "attn_v.weight": "Q8_0", "attn_output.weight": "Q5_0",
         "ffn_gate.weight": "Q4_1", "ffn_up.weight": "Q8_0", "ffn_down.weight": "Q4_0"}


def runners(tmp_path, arch: str):
    path = tmp_path / f"{arch}.gguf"
    hf = tiny_hf_model(arch, seed=7)
    with torch.no_grad():  # sharp attention, so that positions (RoPE) and every key matter
        for layer in hf.model.layers:
            a = layer.self_attn
            for w in (a.q_norm.weight, a.k_norm.weight) if hasattr(a, "q_norm") else (a.q_proj.weight, a.k_proj.weight):
                w.mul_(12 if w is a.q_proj.weight or w is a.k_proj.weight else 1)  # (QK-norm undoes a scaled projection)
    write_gguf(hf, path, arch, quant=QUANT8 if arch == "gemma3" else QUANT)
    native = ModelRunner(GGUFFile(path), torch.bfloat16)
    assert native.native_decoder is not None, "the C decode did not build or a linear has no codes"
    plain = ModelRunner(GGUFFile(path), torch.bfloat16)
    plain.native_decoder = None  # the PyTorch layers, same codes and kernels for the linears
    f32 = ModelRunner(GGUFFile(path), torch.float32)
    return native, plain, f32


@contextlib.contextmanager
def pytorch_layers(runner):
    """Steps on `runner` run its PyTorch layers (a prompt whose keys and values both runners
    then share bit for bit, so their decode steps can be compared tightly)."""
    decoder, runner.native_decoder = runner.native_decoder, None
    try:
        yield
    finally:
        runner.native_decoder = decoder


def close(a: torch.Tensor, b: torch.Tensor, tol: float, argmax: bool = True) -> None:
    """Logits agree to `tol` of their spread, with the same greedy token (if `argmax`)."""
    assert float((a - b).abs().max()) <= tol * float(b.std()), float((a - b).abs().max())
    assert not argmax or torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("arch,cache_dtype", [("llama", "auto"), ("qwen2", "auto"), ("qwen2", "int8"),
                                              ("qwen3", "auto"), ("gemma3", "auto"), ("gemma3", "int8")])
def test_one_stream_decode_matches_pytorch_layers(tmp_path, arch, cache_dtype):
    """qwen2: q/k/v biases, untied head. int8: the C decode quantizes the new keys and values
    as `quantize_rows` does and attends over the codes; the PyTorch layers use the same cache.
    qwen3: QK-norm. gemma3: its norms, GeGLU, and 5 sliding-window layers (window 8, their own
    RoPE base, rings of blocks in reverse order; bf16 rings beside an int8 global layer) over 37
    positions."""
    native, plain, f32 = runners(tmp_path, arch)
    prompt = [5, 17, 200, 33, 41, 270, 90, 12, 7, 7, 150]
    seqs = [OneSequence(native, cache_dtype=cache_dtype), OneSequence(plain, cache_dtype=cache_dtype), OneSequence(f32)]
    with pytorch_layers(native):
        for s in seqs:
            s.forward(prompt)
    for token in [3, 99, 240, 18, 18, 61] + list(range(20, 40)):  # 26 decode steps, past a block boundary
        a, b, c = (s.forward([token]) for s in seqs)
        # Same roundings; only float32 reductions (the norm's mean, exp) may differ in a last bit.
        # (with an int8 cache a key that differs in its last bit can round to the next code)
        close(a, b, 0.02 if cache_dtype == "auto" else 0.04)
        # bf16 and int8 activations (and int8 keys and values) against the float32 model; Gemma's
        # extra norms leave this random 6-layer model's bf16 logits about 0.36 of their spread from
        # float32 on average (0.63 at most; its flat logits then swap greedy tokens): the PyTorch
        # layers' too, which equal the C step's (above)
        close(a, c, 0.25) if arch != "gemma3" else close(a, c, 0.75, argmax=False)
    if cache_dtype == "int8":  # the C decode wrote codes (its quantizer: the test below)
        assert native.kv.k.dtype == torch.int8 and native.kv.k_scale.abs().sum() > 0


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_batched_decodes_match_pytorch_layers(tmp_path, arch):
    """Sequences of different lengths with scattered blocks (and, for Gemma's sliding-window
    layers, scattered rings), decoding together."""
    from nextoken.kv_cache.manager import ring_blocks

    native, plain, _ = runners(tmp_path, arch)
    ring = ring_blocks(native.config.sliding_window, 4) if native.config.sliding_layers else 0
    rings = [[5, 0, 9, 2][:ring], [1, 7, 3, 11][:ring], [10, 4, 6, 8][:ring]] if ring else [None] * 3
    out = []
    for r in (native, plain):
        r.init_kv_cache(32, 4, 12 if ring else 0, ring)
        tables = [[9, 2, 30, 4, 17], [0, 1, 3], [31, 8, 6, 12, 13, 14, 15, 16]]
        lens = [17, 9, 29]
        prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate(lens)]
        with pytorch_layers(r):
            r.execute([SequenceInput(p, 0, t, ring_ids=g) for p, t, g in zip(prompts, tables, rings)])
        steps = []
        for step in range(3):
            seqs = [SequenceInput([40 + step + i], n + step, t, ring_ids=g)
                    for i, (n, t, g) in enumerate(zip(lens, tables, rings))]
            steps.append(r.execute(seqs))
        out.append(torch.stack(steps))
    close(out[0], out[1], 0.02)


def test_kernel_kv_quantization_equals_quantize_rows():
    """decode.c's int8 cache write (`kv_quantize_rows`) against `quantize_rows`, code for code:
    random rows, a zero row, rows with exact .5 ties after scaling, a row of one value."""
    import ctypes

    from nextoken.kernels import load
    from nextoken.kv_cache.tensors import quantize_rows

    lib = load("decode")
    assert lib is not None, "the decode kernel did not build (is gcc installed?)"
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 128, generator=g) * torch.logspace(-3, 3, 64)[:, None]).to(torch.bfloat16)
    x[3] = 0
    x[4] = torch.tensor([127.0, 0.5, 1.5, -2.5, 63.5] * 25 + [0.0] * 3)  # scale 1: ties round to even
    x[5] = -7.0
    codes, scales = torch.empty(64, 128, dtype=torch.int8), torch.empty(64)
    p = ctypes.c_void_p
    lib.kv_quantize_rows(p(x.data_ptr()), 64, 128, p(codes.data_ptr()), p(scales.data_ptr()))
    ref_codes, ref_scales = quantize_rows(x)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    assert ref_codes[4, :5].tolist() == [127, 0, 2, -2, 64] and ref_codes[5].eq(-127).all() and ref_scales[3] == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_short_steps_with_prefill_rows_run_in_one_call(tmp_path, arch, monkeypatch):
    """A step of at most `MAX_PREFILL_TOKENS` new tokens mixing a decode, a prefill chunk that
    starts past a cached prefix, and a 4-row run (speculative verification's shape) runs in the
    C call (`NativeDecoder.takes`): every row's logits agree with the PyTorch layers' to bf16
    rounding (their prefill attention rounds differently: the bound is 8% of the logits'
    spread, as for the quick start), and each row's arithmetic is independent of what else the
    step holds (bit for bit against each sequence alone, and against its tokens fed one decode
    step at a time, and split into calls of a few rows). gemma3: prompts within its rings (12 tokens), scattered ring blocks, the
    last one's rows past its window of 8 (rows at positions 8-10 see keys from 1-3 on); its
    extra norms amplify bf16 roundings (see the test above), so against the PyTorch layers the
    bound is 0.3 of the spread (it measured 0.28), and the decode steps are the tight check."""
    from nextoken.kernels.decode_step import MAX_PREFILL_TOKENS
    from nextoken.kv_cache.manager import ring_blocks
    from nextoken.layers.native_decode import NativeDecoder

    native, plain, _ = runners(tmp_path, arch)
    calls, step = [], NativeDecoder.__call__
    monkeypatch.setattr(NativeDecoder, "__call__", lambda self, *a: calls.append(1) or step(self, *a))
    tables = [[9, 2, 30, 4, 17], [0, 1, 3, 5], [31, 8, 6, 12, 13, 14, 15, 16, 18]]
    sliding = bool(native.config.sliding_layers)
    lens, new = ((3, 2, 4), [[40], [41, 42, 43, 44, 45], [50, 51, 52, 53, 54, 55, 56]]) if sliding else \
        ((17, 9, 29), [[40], [41, 42, 43, 44, 45, 46, 47], [50, 51, 52, 53]])
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate(lens)]
    ring = ring_blocks(native.config.sliding_window, 4) if sliding else 0
    rings = [[5, 0, 9][:ring], [1, 7, 3][:ring], [10, 4, 6][:ring]] if sliding else [None] * 3
    if sliding:
        assert ring * 4 == 12 and max(a + len(b) for a, b in zip(lens, new)) == 11 > native.config.sliding_window

    def run(r, which):
        r.init_kv_cache(32, 4, 12 if ring else 0, ring)
        r.execute([SequenceInput(prompts[i], 0, tables[i], ring_ids=rings[i]) for i in which])
        return r.execute([SequenceInput(new[i], len(prompts[i]), tables[i], ring_ids=rings[i]) for i in which],
                         all_logits=True)

    mixed = run(native, [0, 1, 2])
    assert len(calls) == 2 and sum(map(len, prompts)) <= MAX_PREFILL_TOKENS
    close(mixed, run(plain, [0, 1, 2]), 0.3 if sliding else 0.08, argmax=not sliding)
    alone = torch.cat([run(native, [i]) for i in range(3)])
    assert torch.equal(mixed, alone)
    # in calls of 3 rows (each call's rows, block tables and ring arrays found by their addresses,
    # calls cutting through sequences): the same bits
    monkeypatch.setattr("nextoken.layers.native_decode.ROWS_PER_CALL", 3)
    assert torch.equal(mixed, run(native, [0, 1, 2]))
    monkeypatch.undo()
    native.init_kv_cache(32, 4, 12 if ring else 0, ring)
    fed = []
    for i in range(3):
        for j, token in enumerate(prompts[i] + new[i]):
            logits = native.execute([SequenceInput([token], j, tables[i], ring_ids=rings[i])], all_logits=True)
            fed += [logits] if j >= len(prompts[i]) else []
    assert torch.equal(mixed, torch.cat(fed))


def test_a_step_with_a_long_prefill_splits_in_two_passes(tmp_path, monkeypatch):
    """A long prompt's prefill (past `MAX_PREFILL_TOKENS`) beside a decode and a short prompt:
    the C step takes the two short ones, the PyTorch layers the long one, in two passes; each
    sequence's logits equal its own alone, bit for bit, whatever it shares the step with."""
    from nextoken.kernels.decode_step import MAX_PREFILL_TOKENS
    from nextoken.layers.native_decode import NativeDecoder

    native, _, _ = runners(tmp_path, "qwen2")
    calls, step = [], NativeDecoder.__call__
    monkeypatch.setattr(NativeDecoder, "__call__", lambda self, h, *a: calls.append(h.shape[0]) or step(self, h, *a))
    long_prompt = [(5 * j) % 250 + 3 for j in range(MAX_PREFILL_TOKENS + 12)]
    tables = [list(range(0, 8)), list(range(8, 16)), list(range(16, 16 + len(long_prompt) // 4 + 1))]

    def run(which):
        native.init_kv_cache(64, 4)
        if 0 in which:  # a sequence that decodes
            native.execute([SequenceInput([7, 8, 9, 10, 11], 0, tables[0])])
        seqs = {0: SequenceInput([12], 5, tables[0]), 1: SequenceInput([20, 21, 22], 0, tables[1]),
                2: SequenceInput(long_prompt, 0, tables[2])}
        return native.execute([seqs[i] for i in which])

    calls.clear()
    mixed = run([0, 1, 2])
    assert calls == [5, 1 + 3], calls  # the first sequence's prompt; then its decode and the short prompt
    alone = torch.cat([run([i]) for i in range(3)])
    assert torch.equal(mixed, alone)


def test_which_rows_run_in_one_call():
    from nextoken.kernels.decode_step import MAX_PREFILL_TOKENS
    from nextoken.layers.native_decode import NativeDecoder

    assert NativeDecoder.takes(1, 5000) and NativeDecoder.takes(1, 5000, ring_tokens=16)  # decodes
    assert NativeDecoder.takes(40, MAX_PREFILL_TOKENS)  # a short prompt, chunk or not
    assert not NativeDecoder.takes(40, MAX_PREFILL_TOKENS + 1)  # part of a longer one
    assert NativeDecoder.takes(5, 20, ring_tokens=32)  # a prompt within a sliding-window ring
    assert not NativeDecoder.takes(5, 20, ring_tokens=16)  # a prefill would overwrite ring slots
    assert not NativeDecoder.takes(5, MAX_PREFILL_TOKENS + 1, ring_tokens=4096)


@pytest.mark.parametrize("dim", [64, 128, 256, 80, 36])  # (80: blocks of 16; 36: of 4, no unrolled pass)
def test_kernel_key_rotation_equals_hadamard_rows(dim):
    """decode.c's rotation of an int8 cache's keys and queries (`kv_rotate_rows`: the fast
    Walsh-Hadamard transform's butterflies) against `hadamard_rows` (a float32 matmul by
    `hadamard_matrix`): the same rotation, to float32 rounding."""
    import ctypes

    from nextoken.kernels import load
    from nextoken.kv_cache.tensors import hadamard_matrix, hadamard_rows

    lib = load("decode")
    assert lib is not None, "the decode kernel did not build (is gcc installed?)"
    x = torch.randn(33, dim, generator=torch.Generator().manual_seed(1)) * torch.logspace(-2, 2, dim)
    h = hadamard_matrix(dim)
    got = x.clone()
    lib.kv_rotate_rows(ctypes.c_void_p(got.data_ptr()), 33, dim)
    want = hadamard_rows(x, h)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(x.abs().max()))
    assert not torch.allclose(got, x, atol=1e-2)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_final_norm_in_the_c_step_equals_the_models_own(tmp_path, arch):
    """The C step applies the model's final norm in the same call (`decode_layers`'s
    ``final_norm``: the same kernel function as `DecoderModel.final_norm`'s, Gemma's for Gemma);
    left to the model's own `final_norm` after the call, every logit is the same bit for bit."""
    native, _, _ = runners(tmp_path, arch)
    seq = OneSequence(native)
    seq.forward([5, 17, 200, 33, 41])
    decoder = native.native_decoder
    assert decoder._final_norm is not None  # (set with the layer table, on the first step)
    for token in (3, 99, 240):
        start = seq.num_tokens
        folded = seq.forward([token])
        decoder._final_norm = None  # the same step again (the same key and value rewritten)
        seq.num_tokens = start
        separate = seq.forward([token])
        decoder._final_norm = native.model.norm.data_ptr()
        assert torch.equal(folded, separate)
