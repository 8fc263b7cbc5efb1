"""What a host operation costs right after a CPU decode step, against the same operation warm.

    python benchmarks/cold_ops.py                  # after 1, 16, 128 MiB streamed
    python benchmarks/cold_ops.py --mib 128 --repeat 60

A CPU decode step streams the model's weights through the caches (SmolLM2-135M: about 120 MiB
with its LM head), which evicts the interpreter's and the libraries' code and data. The host work
around the C calls then runs cold: each distinct operation costs tens of microseconds where it
costs one or two warm. This measures that: each operation once after a single-threaded read of
`--mib` MiB (a NumPy sum over a fresh buffer standing in for the step), the median of
`--repeat` such runs, and the same operation warm (run twice, the second timed). The engine's
decode step is written to it: its rows are addressed by arithmetic on tensor addresses
(`layers.native_decode.NativeDecoder`), a ``to`` or ``contiguous`` that would return its input is
not called (`runner.inputs._same_or_cast`), the final norm runs inside the C step
(`kernels.decode_step.decode_layers`), the sampler's settings are read as addresses once per
batch (`sample.sampler.SamplingMetadata.addresses`).

Measured on a 2-core Sapphire Rapids VM (2026-12-02), warm -> after 128 MiB, us: ``torch.empty``
0.7 -> 43, ``x[0]`` 0.7 -> 47, a ``to`` returning its input 0.8 -> 46, ``ids + 1`` 1.4 -> 57,
``torch.tensor`` 2.5 -> 78, ``contiguous`` and ``data_ptr`` 0.1 -> 13, a ctypes call 0.4 -> 19,
``numpy.empty`` 0.2 -> 9, an empty Python ``with`` block 0.8 -> 30 (each op alone: ops in a row
share part of it, the interpreter's own code coming back once). A huge-page buffer streamed
instead changed none of it (the cost is the caches, not the TLB).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import time

import numpy as np
import torch


def operations() -> dict:
    """name -> a call that does one host operation of the decode step's kinds."""
    x, ids = torch.zeros(4, 576), torch.zeros(4, dtype=torch.int64)
    libc = ctypes.CDLL(None)

    @contextlib.contextmanager
    def block():
        yield

    def with_block():
        with block():
            pass

    return {
        "torch.empty": lambda: torch.empty(1, 49152),
        "x[0]": lambda: x[0],
        "x.data_ptr()": lambda: x.data_ptr(),
        "x.contiguous() (contiguous)": lambda: x.contiguous(),
        "ids.to(int64) (int64)": lambda: ids.to(torch.int64),
        "ids + 1": lambda: ids + 1,
        "torch.tensor([1, 2])": lambda: torch.tensor([1, 2]),
        "torch.from_numpy": lambda: torch.from_numpy(np.array([1, 2])),
        "numpy.empty": lambda: np.empty(16),
        "ctypes call": lambda: libc.labs(ctypes.c_long(5)),
        "Python with-block": with_block,
        "Python sum([1, 2, 3])": lambda: sum([1, 2, 3]),
    }


def timed(fn) -> float:
    start = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - start) / 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, nargs="+", default=[1, 16, 128], help="MiB streamed before each timed call")
    ap.add_argument("--repeat", type=int, default=40)
    a = ap.parse_args()
    ops = operations()
    warm = {}
    for name, fn in ops.items():
        runs = []
        for _ in range(a.repeat):
            fn()
            runs.append(timed(fn))
        warm[name] = statistics.median(runs)
    cold = {}
    for mib in a.mib:
        buffer = np.ones(mib * 2**20 // 8)
        for name, fn in ops.items():
            runs = []
            for _ in range(a.repeat):
                buffer.sum()
                runs.append(timed(fn))
            cold[name, mib] = statistics.median(runs)
    print(f"| operation, us (median of {a.repeat}) | warm | " + " | ".join(f"after {m} MiB" for m in a.mib) + " |")
    print("|---|---:|" + "---:|" * len(a.mib))
    for name in ops:
        print(f"| {name} | {warm[name]:.1f} | " + " | ".join(f"{cold[name, m]:.1f}" for m in a.mib) + " |")


if __name__ == "__main__":
    main()
