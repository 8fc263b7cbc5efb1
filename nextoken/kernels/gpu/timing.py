"""How the GPU plan times its kernels against PyTorch's at load (`gemv.choose`,
`skinny.choose`, `sampling.choose_min_rows`): the median of a few runs on the GPU's clock
(CUDA events), after a warm-up run that compiles.

- `graph_seconds`: `fn` captured as a CUDA graph and replayed, as a decode step runs its matmuls
  (without the host's launch costs, which are larger for Triton's Python launcher than for
  cuBLAS's);
- `eager_seconds`: `fn` launched op by op, as the engine runs its sampler (the launches included
  where they hold the GPU up);
- `fastest`: which of a kernel's launches (tiles, warps, stages) times least;
- `remembered`: a timed choice made once per process for its shapes and device (every engine of
  the process that loads the same shapes, e.g. a test run's or a benchmark's, reuses it);
- `per_shape`: a matmul kernel's choice for each group of weights of one shape.
"""

from __future__ import annotations

import torch


def median_seconds(run, reps: int) -> float:
    """The median seconds of `reps` calls of `run` between two CUDA events."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


def graph_seconds(fn, reps: int = 5) -> float:
    """Median seconds of one replay of `fn` captured as a CUDA graph, after a warm-up call on a
    side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    seconds = median_seconds(graph.replay, reps)
    del graph
    return seconds


def eager_seconds(fn, reps: int = 5) -> float:
    """Median seconds of `fn` launched eagerly, after a warm-up call."""
    fn()
    return median_seconds(fn, reps)


def fastest(launches, run, timer) -> tuple[object, dict]:
    """The launch of `launches` under which ``timer(lambda: run(launch))`` is least, and every
    launch's seconds. A launch whose run raises (one this GPU or Triton cannot build) drops out;
    if every one raises, so does this (the last error)."""
    times, failure = {}, None
    for launch in launches:
        try:
            times[launch] = timer(lambda: run(launch))
        except Exception as exc:  # noqa: BLE001 - a launch that does not build here: the others compete
            failure = exc
    if not times:
        raise failure
    return min(times, key=times.get), times


_CHOICES: dict = {}


def remembered(key: tuple, choose):
    """``choose()``, made once per process for `key` (what the timing depends on: the kernel, the
    device, the shapes, the dtype, how many weights a step reads): the same shapes on the same
    GPU time the same, and a timing costs compilations and graph captures at every load."""
    if key not in _CHOICES:
        _CHOICES[key] = choose()
    return _CHOICES[key]


def per_shape(kernel: str, groups: dict, choose_one, timer=None, report: dict | None = None) -> dict:
    """``{key: (rows, launch)}`` for each group of weights of one shape (``{key: [(weight, bias),
    ...]}``) from ``choose_one(pairs, timer) -> (rows, launch, times)``; `report` gets each key's
    times. Without `timer`, each group is timed by `graph_seconds` once per process for its
    kernel, device, shape, dtype, bias and count of weights (`remembered`)."""
    out = {}
    for key, pairs in groups.items():
        w0 = pairs[0][0]
        if timer is None:
            what = (kernel, str(w0.device), tuple(w0.shape), w0.dtype, pairs[0][1] is not None, len(pairs))
            rows, best, times = remembered(what, lambda: choose_one(pairs, graph_seconds))
        else:
            rows, best, times = choose_one(pairs, timer)
        if report is not None:
            report[key] = times
        out[key] = (rows, best)
    return out
