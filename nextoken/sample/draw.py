"""The draw's C kernel (``kernels/sampling.c``'s ``sample_rows``) without PyTorch: each row's
settings as the kernel reads them, and the call. The sampler's batched draw (`Sampler`) and the
first token of ``nextoken run`` (`runner.quick_start`) both go through it, so one seed draws one
token from the same logits whichever path computed them."""

from __future__ import annotations


def row_settings(params, vocab_size: int) -> tuple[float, int, float, float]:
    """A row's ``(temperature, top_k, top_p, min_p)`` as the kernel reads them: temperature 0 for
    greedy, top-k 0 when off (or not below the vocabulary), top-p 1 and min-p 0 when off."""
    top_k = params.top_k if 0 < params.top_k < vocab_size else 0
    return (0.0 if params.greedy else params.temperature), top_k, params.top_p, params.min_p


def sample_rows(lib, rows: int, batch: int, vocab_size: int, temperature: int, top_k: int, top_p: int, min_p: int,
                u: int, tokens: int, finite: int | None = None) -> None:
    """One token per row: `rows` the address of ``batch`` int64 row addresses (float32 logits
    ``[vocab_size]`` each); the settings float32 / int32 / float32 / float32 ``[batch]``, u float32
    ``[batch]`` (one uniform number per row, `sample.rng`) and tokens int64 ``[batch]`` (out), as
    addresses; `finite`: the address of uint8 ``[batch]`` (out) for each row's finiteness (1: no
    NaN or infinity), found in the same pass, or None. Raises `MemoryError` when the kernel
    cannot allocate its scratch memory."""
    if lib.sample_rows(rows, batch, vocab_size, temperature, top_k, top_p, min_p, u, tokens, None, finite):
        raise MemoryError("the sampling kernel could not allocate its scratch memory")


def draw_one(lib, logits, params, u: float) -> int:
    """The token of one float32 NumPy row of logits ``[vocab]`` under `params` (processors off)
    for the uniform number `u` (unused by greedy params)."""
    import numpy as np

    t, k, p, m = row_settings(params, logits.shape[0])
    row = np.ascontiguousarray(logits, dtype=np.float32)
    arrays = (np.array([row.ctypes.data], np.int64), np.array([t], np.float32), np.array([k], np.int32),
              np.array([p], np.float32), np.array([m], np.float32), np.array([u], np.float32), np.zeros(1, np.int64))
    rows, temperature, top_k, top_p, min_p, us, out = arrays
    sample_rows(lib, rows.ctypes.data, 1, row.shape[0], temperature.ctypes.data, top_k.ctypes.data,
                top_p.ctypes.data, min_p.ctypes.data, us.ctypes.data, out.ctypes.data)
    return int(out[0])
