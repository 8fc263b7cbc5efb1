"""Triton's interpreter without two costs that change nothing it computes.

**Discarded overflow checks.**
Under ``TRITON_INTERPRET=1`` every int32 ``+``, ``-`` and ``*`` in a kernel is also computed in
int64 and compared with int32's range, for a ``device_assert`` that only runs with the options'
``debug`` on; the interpreter's options are fixed (``InterpreterOptions()``: ``debug`` off,
``sanitize_overflow`` on, in Triton 3.6 and 3.9 alike), so the check never runs, but its casts,
products and comparisons are still evaluated in NumPy. In the GPU path's tests that was about a
sixth of the interpreter's time (py-spy). Compiled kernels do not pay it: there the unused
values are removed by the compiler.

`skip_discarded_overflow_checks` turns ``sanitize_overflow`` off where ``debug`` is off, which
leaves every computed value the same (only the discarded check goes).

**The language's builtins listed and wrapped on every launch.** Each launch patches
``triton.language``'s builtins for the interpreter and restores them after; to find them it
lists every member of the modules and classes with `inspect.getmembers` (sorted, each attribute
read), about a ninth of the GPU path's tests' time, and wraps each in a new function (under
Triton 3.6 with a new ``TritonSemantic`` each), about a tenth more. `cache_builtin_lists` lists
and wraps each module's or class's builtins once, with Triton's own wrapper, and sets the same
wrappers on every launch.

**The language patched again on every call of a device function.** A kernel's call of another
``@triton.jit`` function (our kernels' ``_load_tile``, ``_gemv_tile``, ``_bisect``, ...) patches
``triton.language`` again for the interpreter, per program and call, although the launch around
it has patched the same modules and restores them when it ends: about a tenth of the
interpreter's time in the suite (py-spy, 2026-12-01). `patch_languages_once_per_launch` skips
that repeat when the launch in progress has patched every language module the function sees.

**Two conversions done the long way.** ``_get_np_dtype`` builds its table of twenty NumPy dtypes on
every call (of every cast, load and constant), and the bf16 <-> float32 casts go through a general
routine for any two float formats, written for subnormals and exponent range changes. Neither
changes between those two formats, which share float32's exponent: `direct_np_dtypes_and_bf16_casts`
looks the dtype up in one table built once from the routine itself, and casts an array with no
subnormal element by its bits (the routine's own arithmetic on them, including its round half up);
other arrays and formats take the routine (tests/test_harness.py compares them).

**Types and tensors built the long way.** Every value a kernel computes is a new ``tensor`` of a
new ``block_type``: the type unwraps and validates its shape and formats its name, the tensor
wraps each of its dimensions and its size in new ``constexpr`` objects; about a quarter of the
interpreter's time in the GEMV's tests (py-spy, 2026-12-02), for the few shapes a kernel uses.
`shared_shapes` builds each shape's validated size, shape name and ``constexpr`` wrappers once,
with Triton's own constructors, and gives every type and tensor of that shape the same ones
(nothing changes a ``constexpr``), each in a language tuple of its own; where Triton's two
constructors are the ones it was written against (Triton 3.9's, by the hash of their source;
3.6's have the same source, and refuse fewer shapes through the functions they call).

`install` applies all five, once per process.

Speed only: with Triton absent, or another interpreter whose internals differ, nothing changes."""

from __future__ import annotations

import dataclasses
import inspect

installed = False


def install() -> bool:
    """The patches below in this process, once; whether the first four are in place."""
    global installed
    if not installed:
        installed = (skip_discarded_overflow_checks() & cache_builtin_lists() & patch_languages_once_per_launch()
                     & direct_np_dtypes_and_bf16_casts())
        shared_shapes()  # (Triton 3.9's and 3.6's constructors: another version keeps its own, as fast as before)
    return installed


def _interpreter():
    """Triton's interpreter module, or None without Triton."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return None
    return interpreter


def skip_discarded_overflow_checks() -> bool:
    """Patch Triton's interpreter builders (the shared one and any made later); whether they are
    patched."""
    interpreter = _interpreter()
    if interpreter is None:
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
    interpreter = _interpreter()
    if interpreter is None:
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


def patch_languages_once_per_launch() -> bool:
    """Replace the interpreter's ``_patch_lang(fn)`` with one that, while a launch
    (``GridExecutor.__call__``) is in progress in this thread and has patched every language
    module in `fn`'s globals, does nothing (a device function's call); the launch's own call and
    any other call patch as before. Whether it is replaced."""
    import threading

    interpreter = _interpreter()
    if interpreter is None:
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    tl = getattr(interpreter, "tl", None)
    if patch_lang is None or executor is None or getattr(tl, "core", None) is None or \
            list(inspect.signature(patch_lang).parameters) != ["fn"]:
        return False
    state = threading.local()
    seen: dict = {}  # function -> the language modules its globals hold (a module's imports are made once)

    def languages(fn) -> frozenset:
        found = seen.get(fn)
        if found is None:
            found = seen[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                         if inspect.ismodule(v) and (v is tl or v is tl.core))
        return found

    class Unchanged:
        """The scope of a patch that was not needed: nothing to restore."""

        def restore(self):
            pass

    def patch_once(fn):
        patched = getattr(state, "patched", None)
        if getattr(state, "launching", False):  # the launch's own patch
            state.launching = False
            state.patched = languages(fn)
        elif patched is not None and languages(fn) <= patched:
            return Unchanged()
        return patch_lang(fn)

    launch = executor.__call__

    def call(self, *args, **kwargs):
        outer = getattr(state, "patched", None)
        state.launching = True
        try:
            return launch(self, *args, **kwargs)
        finally:
            state.launching, state.patched = False, outer

    interpreter._patch_lang = patch_once
    executor.__call__ = call
    return True


def direct_np_dtypes_and_bf16_casts() -> bool:
    """Replace the interpreter's ``_get_np_dtype`` and ``_convert_float`` with the lookups and bf16
    casts of the module's comment; whether both are replaced."""
    import numpy as np

    interpreter = _interpreter()
    if interpreter is None:
        return False
    get_np_dtype = getattr(interpreter, "_get_np_dtype", None)
    convert = getattr(interpreter, "_convert_float", None)
    tl = getattr(interpreter, "tl", None)
    if get_np_dtype is None or convert is None or tl is None or \
            list(inspect.signature(convert).parameters) != ["input", "input_dtype", "output_dtype", "rounding_mode"]:
        return False
    table = {}
    for value in vars(tl.core).values():
        if isinstance(value, tl.dtype) and not isinstance(value, (tl.pointer_type, tl.block_type)):
            try:
                table[value] = get_np_dtype(value)
            except KeyError:  # a type the interpreter has no array for
                pass
    pointer, block = tl.pointer_type, tl.block_type
    address = np.dtype(np.uint64)

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, pointer):
            return address
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, block) else tt_dtype
        if isinstance(scalar, pointer):
            return address
        found = table.get(scalar)
        return found if found is not None else get_np_dtype(tt_dtype)

    interpreter._get_np_dtype = np_dtype
    interpreter._convert_float = bf16_casts_by_bits(convert, tl, interpreter)
    return True


def bf16_casts_by_bits(convert, tl, interpreter):
    """`convert` (the interpreter's ``_convert_float``) with bf16 <-> float32 arrays that hold no
    subnormal taken by their bits: float32 -> bf16 keeps the sign, exponent and the mantissa's top
    7 bits, and with round-to-nearest-even asked adds the first cut bit to those 7 (the routine's
    rounding: half up, its carry ORed into the exponent's lowest bit); bf16 -> float32 shifts the
    bits up 16. The routine computes exactly that for such arrays (no exponent to move: both
    formats have float32's 8 bits and bias 127)."""
    import numpy as np

    rtne = getattr(getattr(getattr(interpreter, "_ir", None), "ROUNDING_MODE", None), "RTNE", object())

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16 and rounding_mode in (None, rtne):
            bits = np.frombuffer(input.tobytes(), dtype=np.uint32)
            if not np.any((bits & 0x7F800000 == 0) & (bits & 0x007FFFFF != 0)):
                out = (bits >> 16) & 0x807F
                exponent = (bits >> 23) & 0xFF
                if rounding_mode is not None:
                    out = (out & 0x8000) | (((bits >> 16) & 0x7F) + ((bits >> 15) & 1))
                return (out | (exponent << 7)).astype(np.uint16).reshape(input.shape)
        elif input_dtype == tl.bfloat16 and output_dtype == tl.float32:
            bits = np.frombuffer(input.tobytes(), dtype=np.uint16)
            if not np.any((bits & 0x7F80 == 0) & (bits & 0x007F != 0)):
                return (bits.astype(np.uint32) << 16).reshape(input.shape)
        return convert(input, input_dtype, output_dtype, rounding_mode)

    convert_float.general = convert
    return convert_float


# sha256 (first 16 hex digits) of the sources of Triton 3.9's (and 3.6's) ``block_type.__init__`` and
# ``tensor.__init__``, which `shared_shapes` replaces with the same attributes made once per shape
CONSTRUCTOR_SOURCES = ("403f4b016ec5c2c3", "d9b043b5c9897657")


def shared_shapes() -> bool:
    """Replace ``block_type.__init__`` and ``tensor.__init__`` with versions that set the same
    attributes (a type: its element type, shape, size and name; a tensor: its handle, type, scalar
    type, size and shape), each shape's made once by Triton's own constructor and reused: the
    size, the name's shape text, the language tuple's type and the ``constexpr`` wrappers are
    shared, every type and tensor gets a tuple of its own. A shape of another kind (constexpr
    dimensions, a Python tuple) takes the original constructor, and one that Triton refuses is
    refused by it every time. Whether they are replaced."""
    import builtins
    import hashlib

    interpreter = _interpreter()
    core = getattr(getattr(interpreter, "tl", None), "core", None)
    block, tensor, lang_tuple = (getattr(core, n, None) for n in ("block_type", "tensor", "tuple"))
    if None in (block, tensor, lang_tuple):
        return False
    try:
        sources = tuple(hashlib.sha256(inspect.getsource(f).encode()).hexdigest()[:16]
                        for f in (block.__init__, tensor.__init__))
    except (OSError, TypeError):
        return False
    if sources != CONSTRUCTOR_SOURCES:
        return False
    block_init, tensor_init = block.__init__, tensor.__init__
    types: dict = {}  # shape (ints) -> (size, the shape's text in the name, its tuple's type)
    tensors: dict = {}  # shape (ints) -> (size, dimensions, its tuple's type): constexpr

    def dims_of(shape):
        if type(shape) is list:
            dims = builtins.tuple(shape)
        elif type(shape) is lang_tuple:
            dims = builtins.tuple(shape.values)
        else:
            return None
        return dims if all(type(d) is int for d in dims) else None

    def init_block_type(self, element_ty, shape):
        dims = dims_of(shape)
        known = types.get(dims) if dims else None
        if known is None:
            block_init(self, element_ty, shape)
            if dims:
                types[dims] = (self.numel, str(self.shape), self.shape.type)
            return
        self.element_ty = element_ty
        self.shape = lang_tuple(list(dims), known[2])
        self.numel = known[0]
        self.name = f"<{known[1]}, {element_ty}>"

    def init_tensor(self, handle, type):
        dims = dims_of(type.shape) if type.is_block() else ()
        known = tensors.get(dims) if dims is not None else None
        if known is None:
            tensor_init(self, handle, type)
            if dims is not None:
                tensors[dims] = (self.numel, self.shape.values, self.shape.type)
            return
        self.handle = handle
        self.numel = known[0]
        self.type = type
        self.dtype = type.scalar
        self.shape = lang_tuple(list(known[1]), known[2])

    init_block_type.original, init_tensor.original = block_init, tensor_init
    block.__init__ = init_block_type
    tensor.__init__ = init_tensor
    return True
