"""Triton's interpreter without two costs that change nothing it computes.

**Discarded overflow checks.**
Under ``TRITON_INTERPRET=1`` every int32 ``+``, ``-`` and ``*`` in a kernel is also computed in
int64 and compared with int32's range, for a ``device_assert`` that only runs with the options'
``debug`` on; the interpreter's options are fixed (``InterpreterOptions()``: ``debug`` off,
``sanitize_overflow`` on, in Triton 3.6 and 3.9 alike), so the check never runs, but its casts,
products and comparisons are still evaluated in NumPy. In the GPU path's tests that was about a
sixth of the interpreter's time (py-spy). Compiled kernels do not pay it: there the unused
values are removed by the compiler.

`install` does both, once per process. `skip_discarded_overflow_checks` turns ``sanitize_overflow`` off where ``debug`` is off, which
leaves every computed value the same (only the discarded check goes).

**The language's builtins listed and wrapped on every launch.** Each launch patches
``triton.language``'s builtins for the interpreter and restores them after; to find them it
lists every member of the modules and classes with `inspect.getmembers` (sorted, each attribute
read), about a ninth of the GPU path's tests' time, and wraps each in a new function (under
Triton 3.6 with a new ``TritonSemantic`` each), about a tenth more. `cache_builtin_lists` lists
and wraps each module's or class's builtins once, with Triton's own wrapper, and sets the same
wrappers on every launch.

Speed only: with Triton absent, or another interpreter whose internals differ, nothing changes."""

from __future__ import annotations

import dataclasses
import inspect

installed = False


def install() -> bool:
    """Both patches below in this process, once; whether both are in place."""
    global installed
    if not installed:
        installed = skip_discarded_overflow_checks() & cache_builtin_lists()
    return installed


def skip_discarded_overflow_checks() -> bool:
    """Patch Triton's interpreter builders (the shared one and any made later); whether they are
    patched."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    options = getattr(interpreter, "InterpreterOptions", None)
    if builder is None or options is None or not {"debug", "sanitize_overflow"} <= \
            {f.name for f in dataclasses.fields(options)}:
        return False
    init = builder.__init__

    def without_discarded_checks(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if not self.options.debug:
            self.options = dataclasses.replace(self.options, sanitize_overflow=False)

    builder.__init__ = without_discarded_checks
    shared = getattr(interpreter, "interpreter_builder", None)
    if shared is not None and not shared.options.debug:
        shared.options = dataclasses.replace(shared.options, sanitize_overflow=False)
    return True


def cache_builtin_lists() -> bool:
    """Replace the interpreter's ``_patch_builtin`` (the members of a module or class that are
    builtins, each wrapped for the launch by ``_patch_attr``) with one that lists and wraps them
    once per module or class and builder: the first listing is of the unpatched members (patches
    are restored after each launch), the wrappers are ``_patch_attr``'s own. Whether it is
    replaced."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    core = getattr(getattr(interpreter, "tl", None), "core", None)
    if patch is None or patch_attr is None or getattr(core, "is_builtin", None) is None or \
            list(inspect.signature(patch).parameters) != ["pkg", "builder", "scope"] or \
            list(inspect.signature(patch_attr).parameters) != ["obj", "name", "member", "builder", "scope"]:
        return False
    wrapped: dict = {}

    class Record:
        """A patch scope that keeps what `_patch_attr` would set."""

        def set_attr(self, obj, name, value):
            self.value = value

    def patch_builtins(pkg, builder, scope):
        pairs = wrapped.get((pkg, builder))
        if pairs is None:
            pairs = []
            for name, member in inspect.getmembers(pkg):
                if core.is_builtin(member):
                    record = Record()
                    patch_attr(pkg, name, member, builder, record)
                    pairs.append((name, record.value))
            wrapped[(pkg, builder)] = pairs
        for name, value in pairs:
            scope.set_attr(pkg, name, value)

    interpreter._patch_builtin = patch_builtins
    return True
