"""The GPU sampler's draw (`kernels.gpu.sampling`) against the sampler's plain PyTorch rule
(`sample.sampler.torch_draw`, whose sorts and float64 sums it replaces), token for token, and the
sampler's switch to it.

Without a GPU the kernel's own source runs under Triton's interpreter (``TRITON_INTERPRET=1``,
set by tests/conftest.py); with one (``TRITON_INTERPRET=0``, as benchmarks/gpu_check.py runs the
tests) compiled, on CUDA tensors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is a test dependency (pyproject's test extra)")

from nextoken.kernels.gpu.sampling import draw_rows  # noqa: E402
from nextoken.sample.sampler import torch_draw  # noqa: E402
from tests.helpers.triton_device import DEV  # noqa: E402

DEVICE = torch.device(DEV)


def settings(b: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random per-row settings: greedy rows, temperature alone, top-k (K up to 40), top-p, min-p
    and their mixtures."""
    T = torch.rand(b, generator=g) * 1.5 + 0.2
    T[::9] = 0.0
    K = (torch.randint(1, 40, (b,), generator=g) * (torch.rand(b, generator=g) < 0.5)).to(torch.int32)
    P = torch.where(torch.rand(b, generator=g) < 0.6, torch.rand(b, generator=g), torch.ones(b))
    M = torch.where(torch.rand(b, generator=g) < 0.3, torch.rand(b, generator=g) * 0.5, torch.zeros(b))
    return T, K, P, M


def assert_same_draws(rows: torch.Tensor, T, K, P, M, u) -> None:
    """The kernel's tokens, with its scratch (the default) and recomputing each pass, are the plain
    rule's."""
    want = torch_draw(rows, T, K, P, M, u)
    for cached in (True, False):
        got = draw_rows(*(t.to(DEVICE) for t in (rows, T, K, P, M, u)), cached=cached)
        assert got.dtype == torch.int64 and got.device.type == DEVICE.type
        assert got.cpu().tolist() == want.tolist(), cached


def test_the_draw_is_the_plain_rule_on_tied_and_masked_rows():
    """Rows of few distinct values (so the top-k and top-p cuts fall inside groups of tied tokens,
    which the rule orders by id), rows with every other token at -inf (a grammar's mask), flat
    rows and peaked ones, under random settings and uniform numbers: the same token as the plain
    rule's every time."""
    g = torch.Generator().manual_seed(1)
    b, V = 27, 300
    rows = torch.randint(0, 6, (b, V), generator=g).float() * 0.5
    rows[::5] = torch.randn(rows[::5].shape, generator=g) * 4
    rows[1::7, ::2] = float("-inf")
    rows[2] = 0.0
    rows[3] = torch.randn(V, generator=g) * 30
    assert_same_draws(rows, *settings(b, g), torch.rand(b, generator=g))


def test_the_draw_at_the_ends_of_u_and_of_the_settings():
    """u = 0 and the largest float32 below 1, top-p 0 (the best token alone), top-k 1 and V - 1,
    min-p 1 and a vocabulary longer than the kernel's tile: the plain rule's tokens."""
    g = torch.Generator().manual_seed(2)
    b, V = 8, 4500
    rows = torch.randn(b, V, generator=g) * 2
    rows[:, 100] = rows[:, 4000] = rows.max() + 1  # the best tokens tied, far apart
    T = torch.tensor([0.0, 1.0, 0.7, 1.0, 1.2, 1.0, 0.9, 1.0])
    K = torch.tensor([0, 0, 1, V - 1, 0, 0, 7, 0], dtype=torch.int32)
    P = torch.tensor([1.0, 0.0, 1.0, 0.95, 0.5, 1.0, 0.9, 0.999])
    M = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.02, 0.0])
    assert_same_draws(rows, T, K, P, M, torch.tensor([0.0, 1 - 2.0**-24] * 4))


def test_a_batch_past_the_scratch_draws_in_launches_of_its_rows(monkeypatch):
    """More rows than `SCRATCH_ROWS` (4 here) are drawn a launch of 4 at a time over one scratch:
    the plain rule's tokens still, the last launch's 3 rows included."""
    import nextoken.kernels.gpu.sampling as S

    monkeypatch.setattr(S, "SCRATCH_ROWS", 4)
    g = torch.Generator().manual_seed(5)
    b, V = 11, 700
    rows = torch.randn(b, V, generator=g) * 3
    assert_same_draws(rows, *settings(b, g), torch.rand(b, generator=g))


def test_a_row_draws_the_same_alone_and_in_a_batch():
    """One program a row: a row's token does not depend on the rows beside it."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(3, 300, generator=g) * 3
    T, K, P, M = (torch.tensor([0.8] * 3), torch.tensor([0, 30, 5], dtype=torch.int32),
                  torch.tensor([0.9, 1.0, 0.8]), torch.tensor([0.0, 0.1, 0.0]))
    u = torch.rand(3, generator=g)
    batch = draw_rows(*(t.to(DEVICE) for t in (rows, T, K, P, M, u))).cpu()
    for i in range(3):
        alone = draw_rows(*(t[i : i + 1].to(DEVICE) for t in (rows, T, K, P, M, u))).cpu()
        assert alone.item() == batch[i].item()


def test_rows_it_does_not_take():
    """bf16 rows, strided rows and settings of another dtype: None (the sampler's PyTorch path
    runs, counted as a fallback)."""
    rows = torch.randn(2, 64)
    T, K, P, M, u = torch.ones(2), torch.zeros(2, dtype=torch.int32), torch.ones(2), torch.zeros(2), torch.rand(2)
    assert draw_rows(rows.to(torch.bfloat16), T, K, P, M, u) is None
    assert draw_rows(rows[:, ::2], T, K, P, M, u) is None
    assert draw_rows(rows, T, K.long(), P, M, u) is None


def test_the_sampler_draws_on_the_kernel_as_on_its_plain_path():
    """`Sampler(triton_min_rows=1)` on seeded rows (greedy, top-p, top-k with min-p) gives the
    tokens of the plain sampler's `launch` with the same seeds, and counts no fallback."""
    from nextoken.kernels import FallbackCounts, counting
    from nextoken.sample.sampler import Sampler, SamplerRequest, make_generator
    from nextoken.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(4, 400, generator=g) * 3).to(DEVICE)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9, seed=1),
              SamplingParams(temperature=1.0, top_k=20, min_p=0.05, seed=2), SamplingParams(temperature=0.6, seed=3)]

    def draws(sampler: Sampler) -> list[list[int]]:
        rows = [SamplerRequest(p, [], [], None if p.seed is None else make_generator(p.seed)) for p in params]
        return [sampler.launch(logits, rows, check_finite=False).results()[0] for _ in range(3)]

    counts = FallbackCounts()
    with counting(counts):
        got = draws(Sampler(triton_min_rows=1))
    assert [[r.token for r in step] for step in got] == [[r.token for r in step] for step in draws(Sampler())]
    assert not counts.snapshot()


def test_the_row_count_from_which_the_kernel_is_faster():
    """`choose_min_rows` (with a stand-in timer: its timing needs CUDA) picks the fewest rows from
    which the kernel timed faster at that size and every larger one; none when it is slower at
    the largest."""
    from nextoken.kernels.gpu.sampling import choose_min_rows

    def timer_of(times):
        seq = iter(times)  # (ours, PyTorch's) per size, in order
        return lambda fn: next(seq)

    sizes = (1, 4, 16)
    assert choose_min_rows(50, torch.device("cpu"), torch_draw, timer_of([3, 2, 1, 2, 1, 2]), sizes)[0] == 4
    assert choose_min_rows(50, torch.device("cpu"), torch_draw, timer_of([1, 2, 3, 2, 1, 2]), sizes)[0] == 16
    assert choose_min_rows(50, torch.device("cpu"), torch_draw, timer_of([1, 2, 1, 2, 3, 2]), sizes)[0] == 0
    rows, times = choose_min_rows(50, torch.device("cpu"), torch_draw, timer_of([1, 2, 1, 2, 1, 2]), sizes)
    assert rows == 1 and times == {1: (1, 2), 4: (1, 2), 16: (1, 2)}


def test_the_plan_and_the_sampler_take_the_timed_rows_or_pytorch(tiny_gguf, monkeypatch):
    """On a GPU the plan times the draw at load (here a stand-in) and the sampler takes the kernel
    for batches of at least that many rows with a sampled one, PyTorch's below (and argmax for a
    greedy batch); a timing that raises leaves
    PyTorch's draw, and the plan line says why."""
    import dataclasses

    import nextoken.kernels.gpu.sampling as S
    from nextoken.loader.source import open_model
    from nextoken.runner.device import Device, resolve_device
    from nextoken.runner.model_runner import ModelRunner
    from nextoken.sample.sampler import Sampler, SamplerRequest
    from nextoken.sampling_params import SamplingParams

    runner = ModelRunner(open_model(str(tiny_gguf["qwen2"][0])), torch.float32, enforce_eager=True,
                         attention_backend="triton", device=resolve_device(DEV))  # (compiled: on the GPU)
    gpu = dataclasses.replace(runner.plan, device=Device(torch.device("cuda"), "a GPU", "asked for"),
                              triton_sampling=True)
    monkeypatch.setattr(S, "choose_min_rows", lambda vocab, device, reference: (3, {3: (1e-4, 2e-4)}))
    gpu._choose_sampling(runner.config.vocab_size)
    assert gpu.sampling_rows == 3 and "sampler: Triton draw from 3 rows" in gpu.describe(runner.model)
    sampler = Sampler.for_plan(frozenset(), None, gpu)
    calls = []
    draw = sampler.triton_draw
    sampler.triton_draw = lambda rows, *a: calls.append(rows.shape[0]) or draw(rows, *a)
    logits = torch.randn(4, 64).to(DEVICE)
    for b in (2, 4):
        sampler.launch(logits[:b], [SamplerRequest(SamplingParams(temperature=0.7), [], [], None)] * b).results()
    greedy = sampler.launch(logits, [SamplerRequest(SamplingParams(temperature=0), [], [], None)] * 4).results()[0]
    assert calls == [4] and [r.token for r in greedy] == logits.argmax(-1).tolist()  # (all greedy: PyTorch's argmax)

    def broken(vocab, device, reference):
        raise RuntimeError("ptxas failed")

    monkeypatch.setattr(S, "choose_min_rows", broken)
    gpu._choose_sampling(runner.config.vocab_size)
    assert gpu.sampling_rows == 0 and "Triton draw off: RuntimeError: ptxas failed" in gpu.describe(runner.model)
    assert Sampler.for_plan(frozenset(), None, gpu).triton_draw is None
