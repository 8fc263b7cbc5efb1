"""gguf-py's `GGUFReader` with its file as a plain NumPy array instead of an `np.memmap`.

The reader parses the header with one NumPy slice per value (a 49k-token vocabulary: about a
million slices), and every slice of an `np.memmap` runs the subclass's Python hooks
(``__array_finalize__``, ``__getitem__``): two thirds of the 3 s it takes to open SmolLM2's file.
Over a plain array backed by the same read-only mapping of the file, the reader sees the same
bytes and gives the same fields and tensors (1 s). Speed only, for the tests whose oracle is the
reader."""

from __future__ import annotations

import contextlib
import mmap
import types
from unittest import mock

import numpy as np

ACCESS = {"r": mmap.ACCESS_READ, "c": mmap.ACCESS_COPY, "r+": mmap.ACCESS_WRITE}


def _mapped_array(path, mode: str = "r", **kwargs) -> np.ndarray:
    """The file's bytes as a uint8 array over a mapping of it (`np.memmap`'s default arguments)."""
    if kwargs or mode not in ACCESS:  # anything else: as gguf-py asked
        return np.memmap(path, mode=mode, **kwargs)
    with open(path, "rb" if mode != "r+" else "r+b") as f:
        return np.frombuffer(mmap.mmap(f.fileno(), 0, access=ACCESS[mode]), dtype=np.uint8)


@contextlib.contextmanager
def plain_arrays():
    """Within: `gguf.GGUFReader` reads its files as plain arrays (numpy as gguf_reader sees it,
    `np.memmap` aside, is numpy)."""
    from gguf import gguf_reader

    numpy = types.SimpleNamespace(**{k: getattr(np, k) for k in dir(np) if not k.startswith("__")})
    numpy.memmap = _mapped_array
    with mock.patch.object(gguf_reader, "np", numpy):
        yield
