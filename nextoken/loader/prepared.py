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
_keys: dict[str, Future] = {}
_keys_lock = threading.Lock()


def prefetch_file_key(path: str | os.PathLike) -> None:
    """Start hashing `path` on a background thread (hashlib releases the GIL, so it runs beside
    the imports); `file_key` then waits for it. Quietly does nothing for a missing file."""
    path = os.path.realpath(path)
    if not os.path.isfile(path):
        return
    with _keys_lock:
        if path in _keys:
            return
        fut: Future = Future()
        _keys[path] = fut

    def work():  # 16 MiB reads: few GIL hand-overs (readinto and update release it for the bulk)
        try:
            h, buf = hashlib.sha256(), bytearray(HASH_CHUNK)
            view = memoryview(buf)
            with open(path, "rb", buffering=0) as fh:
                while n := fh.readinto(buf):
                    h.update(view[:n])
            fut.set_result(h.hexdigest())
        except OSError as exc:
            fut.set_exception(exc)

    threading.Thread(target=work, name="nextoken-file-key", daemon=True).start()


def file_key(path: str | os.PathLike) -> str:
    """The SHA-256 (hex) of the file at `path`, hashed once per process (and file state)."""
    real = os.path.realpath(path)
    prefetch_file_key(real)
    return _keys[real].result()


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
