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

def _mapped_array(path, mode: str = "r", **kwargs) -> np.ndarray:
    """The file's bytes as a read-only uint8 array over a mapping of it (the reader's default
    ``mode="r"``); any other call is `np.memmap`'s."""
    if kwargs or mode != "r":
        return np.memmap(path, mode=mode, **kwargs)
    with open(path, "rb") as f:
        return np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)


@contextlib.contextmanager
def plain_arrays():
    """Within: `gguf.GGUFReader` reads its files as plain arrays (numpy as gguf_reader sees it,
    `np.memmap` aside, is numpy)."""
    from gguf import gguf_reader

    numpy = types.SimpleNamespace(**{k: getattr(np, k) for k in dir(np) if not k.startswith("__")})
    numpy.memmap = _mapped_array
    with mock.patch.object(gguf_reader, "np", numpy):
        yield
