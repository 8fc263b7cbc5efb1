"""`torch.compile` for the few small functions where it pays, with an eager switch.

Compiled (Inductor, C++ on CPU) versions fuse chains of element-wise operations into one loop;
the eager versions are the reference and what `--enforce-eager` (or ``NEXTOKEN_ENFORCE_EAGER=1``)
runs. A function is compiled on its first call (a few seconds, then cached on disk by Inductor).
Tests hold both versions equal.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

_state = {"eager": os.environ.get("NEXTOKEN_ENFORCE_EAGER", "") not in ("", "0")}


def set_enforce_eager(eager: bool) -> None:
    """Run every `maybe_compiled` function eagerly (True) or compiled (False)."""
    _state["eager"] = bool(eager)


def enforce_eager() -> bool:
    return _state["eager"]


def maybe_compiled(fn: Callable) -> Callable:
    """`fn`, compiled with dynamic shapes unless eager mode is on (checked at every call)."""
    compiled = []

    def call(*args):
        if _state["eager"]:
            return fn(*args)
        if not compiled:
            compiled.append(torch.compile(fn, dynamic=True))
        return compiled[0](*args)

    call.eager = fn
    call.__doc__ = fn.__doc__
    call.__name__ = fn.__name__
    return call
