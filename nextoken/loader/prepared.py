"""The prepared-weights cache: GGUF weights already repacked for our kernels, memory-mapped on
later starts instead of repacked again.

Repacking GGUF blocks into the tiled codes of ``kernels/qmatmul.c`` (`qweight.QuantWeight.pack`)
is most of a cold start: 11 s for Qwen2.5-1.5B on this machine. The first load of a file writes
what it packed to ``<cache>/prepared/<sha256>-v<LAYOUT_VERSION>.safetensors``
(`catalog.cache_dir`): each weight's tensors as ``<name>/<field>``, its integers and the key in
the metadata (JSON). Later loads of the same bytes open it with `safetensors`, which maps the
file: the codes are pages of it, read on first use. Nothing is unpickled.

Trust: the file name and its header both carry the model file's SHA-256 and `LAYOUT_VERSION`
(bump it whenever `QuantWeight`'s layout or packing changes); a cache whose key does not match,
that cannot be read (truncated, damaged), or that lacks a weight or holds one of another shape is
not used: the weights are packed again and the cache rewritten. The hash of a large file takes
most of a second, so `prefetch_file_key` starts it on a second thread while the process imports
PyTorch. Writes go through a temporary file and `os.replace`: a concurrent reader never sees half
a cache. ``--no-prepared-cache`` (`EngineArgs.prepared_cache`) turns it off.

The hash itself is remembered across starts (``<cache>/prepared/keys/``, one small JSON file per
model path), under the file's identity: device, inode, size, and the modification and change
times in nanoseconds. Any write to the file changes its change time (which the kernel sets and
no program can set back), a replaced file has another inode, so an unchanged identity means
unchanged bytes, as git's index and ccache assume; anything else hashes again. That saves the
hash's time on every later start: 0.5-1 s of the quick start's critical path for Qwen2.5-1.5B's
1.1 GB on this VM, 3 s for a 4.7 GB 7B file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

LAYOUT_VERSION = 1
HASH_CHUNK = 16 << 20
_FIELDS = ("codes", "scales", "mins", "scale_sup", "min_sup")  # QuantWeight's tensors (mins, *_sup may be None)
_INTS = ("bits", "group", "gps")
_keys: dict[tuple[str, tuple[int, ...]], Future] = {}
_keys_lock = threading.Lock()


def _identity(path: str) -> tuple[int, ...] | None:
    """The file's identity (device, inode, size, mtime and ctime in ns), or None when missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _memo_path(path: str) -> Path:
    from nextoken.catalog import cache_dir

    return cache_dir() / "prepared" / "keys" / f"{hashlib.sha256(path.encode()).hexdigest()[:32]}.json"


def _remembered(path: str, identity: tuple[int, ...]) -> str | None:
    """The hash remembered for `path` at this identity, or None (none, another identity, unreadable)."""
    try:
        memo = json.loads(_memo_path(path).read_text())
        if memo["path"] == path and tuple(memo["identity"]) == identity and len(memo["sha256"]) == 64:
            return str(memo["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _remember(path: str, identity: tuple[int, ...], digest: str) -> None:
    """Keep `digest` for `path` at `identity` (quietly nothing where the cache cannot be written)."""
    memo = _memo_path(path)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps({"path": path, "identity": list(identity), "sha256": digest}))
        os.replace(tmp, memo)
    except OSError:
        pass


def _hash(path: str) -> str:
    """SHA-256 of the file, in 16 MiB reads: few GIL hand-overs (readinto and update release it
    for the bulk, so it runs beside the imports)."""
    h, buf = hashlib.sha256(), bytearray(HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def prefetch_file_key(path: str | os.PathLike) -> None:
    """Start finding the key of `path` on a background thread (the remembered hash, or hashing
    it); `file_key` then waits for it. Quietly does nothing for a missing file."""
    path = os.path.realpath(path)
    identity = _identity(path)
    if identity is None or not os.path.isfile(path):
        return
    with _keys_lock:
        if (path, identity) in _keys:
            return
        fut: Future = Future()
        _keys[(path, identity)] = fut

    def work():
        try:
            digest = _remembered(path, identity)
            if digest is None:
                digest = _hash(path)
                if _identity(path) == identity:  # not written to while it was read
                    _remember(path, identity, digest)
            fut.set_result(digest)
        except OSError as exc:
            fut.set_exception(exc)

    threading.Thread(target=work, name="nextoken-file-key", daemon=True).start()


def file_key(path: str | os.PathLike) -> str:
    """The SHA-256 (hex) of the file at `path`: remembered for its identity, else hashed; once
    per process and file state. Raises OSError for a file that cannot be read."""
    real = os.path.realpath(path)
    prefetch_file_key(real)
    identity = _identity(real)
    fut = _keys.get((real, identity))
    if fut is None:
        raise FileNotFoundError(real)
    return fut.result()


class PreparedWeights:
    """The cache for one GGUF file: `codes(name, build)` returns the stored `QuantWeight` of
    tensor `name`, or builds it with `build()` and keeps it for `save`."""

    def __init__(self, model_path: str, directory: Path | None = None):
        from nextoken.catalog import cache_dir

        self.key = file_key(model_path)
        self.path = (directory or cache_dir() / "prepared") / f"{self.key}-v{LAYOUT_VERSION}.safetensors"
        self.stored = self._read()
        self.built: dict[str, dict] = {}

    def _read(self) -> dict[str, dict]:
        """name -> {field: tensor, "offset": float, "bits"/"group"/"gps": int}, or {} when the
        cache is absent or not usable (a warning says why)."""
        from safetensors import safe_open

        if not self.path.is_file():
            return {}
        try:
            with safe_open(str(self.path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("key") != self.key or meta.get("layout") != str(LAYOUT_VERSION):
                    raise ValueError("its key does not match the model file")
                weights = {name: dict(zip(("offset", *_INTS), values))
                           for name, values in json.loads(meta["params"]).items()}
                for key in f.keys():
                    name, field_ = key.rsplit("/", 1)
                    weights[name][field_] = f.get_tensor(key)
            return weights
        except Exception as exc:  # a damaged file raises anything from I/O to header and JSON errors
            log.warning("prepared-weights cache %s is not usable (%s: %s); packing the weights again",
                        self.path, type(exc).__name__, exc)
            return {}

    def codes(self, name: str, rows: int, cols: int, build: Callable):
        """The `QuantWeight` of tensor `name` (``[rows, cols]``), from the cache or `build()`."""
        from nextoken.layers.quantization.qweight import QuantWeight

        entry = self.stored.get(name)
        if entry is not None:
            qw = QuantWeight(**{k: entry.get(k) for k in _FIELDS}, **{k: entry[k] for k in ("offset", *_INTS)})
            if qw.shape == (rows, cols) and qw.codes.numel() * 8 == rows * cols * qw.bits:
                return qw
            log.warning("prepared-weights cache %s holds %s in another shape than %s; packing the weights again",
                        self.path, name, (rows, cols))
            self.stored = {}
        qw = build()
        self.built[name] = {k: getattr(qw, k) for k in (*_FIELDS, "offset", *_INTS)}
        return qw

    def save(self) -> None:
        """Write the cache when anything was packed in this load (every weight, stored or new).
        A folder that cannot be written is one warning; the model still runs."""
        from safetensors.torch import save_file

        if not self.built:
            return
        weights = {**self.stored, **self.built}
        tensors = {f"{name}/{k}": w[k].contiguous() for name, w in weights.items() for k in _FIELDS
                   if w.get(k) is not None}
        params = {name: [w["offset"], *(w[k] for k in _INTS)] for name, w in weights.items()}
        meta = {"key": self.key, "layout": str(LAYOUT_VERSION), "params": json.dumps(params)}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            save_file(tensors, str(tmp), metadata=meta)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("cannot write the prepared-weights cache %s (%s)", self.path, exc)
