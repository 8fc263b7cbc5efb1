"""Thread settings for the compute kernels.

PyTorch's intra-op pool (OpenMP) does the work of every kernel; by default it gets one thread per
core this process may run on (``os.sched_getaffinity``, which respects CPU sets and
``taskset``), not per hyper-thread, or fewer if ``OMP_NUM_THREADS`` asks for fewer. The
inter-op pool gets one thread: the model runs one op at a time, and a second pool would only
compete with the first for the same cores. The server's event loop and the engine's step thread
mostly wait, so they take no core of their own.
"""

from __future__ import annotations

import os

from nextoken.errors import InvalidRequest


def default_threads() -> int:
    """The cores this process may use, or fewer where ``OMP_NUM_THREADS`` (a positive count, as
    PyTorch and OpenMP read it) says so: more threads than cores only spin against each other."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        cores = max(1, os.cpu_count() or 1)
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    return min(int(env), cores) if env.isdigit() and int(env) >= 1 else cores


def configure_threads(num_threads: int | None = None) -> int:
    """Set the intra-op threads (default `default_threads()`) and one inter-op thread; returns
    the intra-op count. Raises `InvalidRequest` for a count below 1."""
    if num_threads is not None and num_threads < 1:
        raise InvalidRequest(f"threads must be >= 1, got {num_threads}", "threads")
    import torch  # here: `default_threads` serves the torch-free quick start (`runner.quick_start`)

    n = num_threads or default_threads()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or inter-op work already started: keep what is there
        pass
    return n
