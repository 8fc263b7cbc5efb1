"""The prepared-weights cache: GGUF weights already repacked for our kernels, memory-mapped on
later starts instead of repacked again.

Repacking GGUF blocks into the tiled codes of ``kernels/qmatmul.c`` (`qweight.QuantWeight.pack`)
is most of a cold start. The first load of a file writes
what it packed to ``<cache>/prepared/<sha256>-v<LAYOUT_VERSION>.safetensors``
(`catalog.cache_dir`): each weight's tensors as ``<name>/<field>``, its integers and the key in
the metadata (JSON), and the small dense tensors the model holds beside the codes (norms, biases,
as ``<name>``, in the model's dtype; RoPE's frequencies as ``rope.inv_freq``). Later loads of the same bytes map the file (`PreparedFile`,
NumPy, copy-on-write): the codes are pages of it, read on first use. Nothing is unpickled. The
same reader serves the first token of ``nextoken run`` (`runner.quick_start`), before PyTorch is
imported: everything that token needs is in this file.

Trust: the file name and its header both carry the model file's SHA-256 and `LAYOUT_VERSION`
(bump it whenever `QuantWeight`'s layout or packing changes; writing a layout removes the same
model's files of other layouts), and the header the lut tables the codes index; a cache whose key
or tables do not match,
that cannot be read (truncated, damaged), or that lacks a weight or holds one of another shape is
not used: the weights are packed again and the cache rewritten. The hash of a large file takes
most of a second, so `prefetch_file_key` starts it on a second thread while the process imports
PyTorch. Writes go through a temporary file and `os.replace`: a concurrent reader never sees half
a cache. ``--no-prepared-cache`` (`EngineArgs.prepared_cache`) turns it off.

A SentencePiece vocabulary's BPE merges (the GGUF keeps none: `tokenizer.tokenizer.sentencepiece_merges`
finds them, 1.1 s for Gemma 3's 262k pieces) are kept beside the weights, as their pairs of ids
(`merges_path`), and read back on later starts.

The hash itself is remembered across starts (``<cache>/prepared/keys/``, one small JSON file per
model path), under the file's identity: device, inode, size, and the modification and change
times in nanoseconds. Any write to the file changes its change time (which the kernel sets and
no program can set back), a replaced file has another inode, so an unchanged identity means
unchanged bytes, as git's index and ccache assume; anything else hashes again. That saves the
hash's time (reading the whole file) on every later start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

from nextoken.kernels.structs import LUT_VALUES, lut_table

log = logging.getLogger(__name__)

# 2: the dense norms and biases, and RoPE's frequencies, too; 3: IQ4 as 4-bit indices (lut);
# 4: lut ids 2-4 (the IQ3_XXS, IQ2 and IQ1_S tables, centred: `nextoken.kernels.structs.lut_table`); 5: Q3_K,
# Q2_K, IQ2_XS and IQ2_S in the 4-bit layout of groups of 16; 6: the sliding-window layers' RoPE frequencies
LAYOUT_VERSION = 6
# the lut tables the codes' indices were packed for (`nextoken.kernels.structs.lut_table`), kept in
# every file and compared at load: a file packed for other tables is re-packed, whatever its layout
_LUTS = json.dumps({k: lut_table(k) for k in LUT_VALUES})
PREPARED_INV_FREQ = "rope.inv_freq"  # float32 [rope_dim / 2], as the model computed them
PREPARED_INV_FREQ_LOCAL = "rope.inv_freq_local"  # the same for sliding-window layers' own base (Gemma 3)
HASH_CHUNK = 16 << 20
_FIELDS = ("codes", "scales", "mins", "scale_sup", "min_sup")  # QuantWeight's tensors (mins, *_sup may be None)
_INTS = ("bits", "group", "gps", "lut")
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


_ST_DTYPES = {"U8": "uint8", "I8": "int8", "U16": "uint16", "F16": "float16", "F32": "float32", "BF16": "uint16",
              "I32": "int32", "I64": "int64"}  # safetensors dtype -> NumPy (bf16: its bits)


class PreparedFile:
    """A prepared-weights cache file mapped as NumPy arrays (copy-on-write: writable views, pages
    shared until written), torch-free. `params`: weight name -> ``[offset, bits, group, gps, lut]``;
    `array(key)` the stored array (``<name>/<field>`` or a dense ``<name>``; bf16 as uint16
    bits), `dtype(key)` its safetensors dtype. Raises `ValueError` when the file's key, layout or
    lut tables are not `key` / `LAYOUT_VERSION` / this version's, `OSError` when it cannot be read."""

    def __init__(self, path: str, key: str):
        with open(path, "rb") as fh:
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        n = int.from_bytes(self._map[:8], "little")
        header = json.loads(self._map[8 : 8 + n])
        meta = header.pop("__metadata__", {}) or {}
        if meta.get("key") != key or meta.get("layout") != str(LAYOUT_VERSION):
            raise ValueError("its key does not match the model file")
        if meta.get("luts") != _LUTS:
            raise ValueError("its lookup tables are not this version's")
        self.params = json.loads(meta["params"])
        self._entries, self._base = header, 8 + n

    def keys(self) -> list[str]:
        return list(self._entries)

    def dtype(self, key: str) -> str:
        return self._entries[key]["dtype"]

    def array(self, key: str):
        """The stored array `key` (shape as stored), or None when absent."""
        import numpy as np

        e = self._entries.get(key)
        if e is None:
            return None
        start, end = e["data_offsets"]
        dtype = np.dtype(_ST_DTYPES[e["dtype"]])
        return np.frombuffer(self._map, dtype=dtype, count=(end - start) // dtype.itemsize,
                             offset=self._base + start).reshape(e["shape"])


class PreparedWeights:
    """The cache for one GGUF file, or for a Hugging Face folder quantized at load to the format
    `variant` (``--quantization``; the key then covers the folder's content and the format):
    `codes(name, build)` returns the stored `QuantWeight` of tensor `name`, or builds it with
    `build()` and keeps it for `save`."""

    def __init__(self, model_path: str, directory: Path | None = None, variant: str | None = None):
        from nextoken.catalog import cache_dir

        self.key = file_key(model_path) if variant is None else \
            hashlib.sha256(f"{content_key(model_path)}:{variant}".encode()).hexdigest()
        self.path = (directory or cache_dir() / "prepared") / f"{self.key}-v{LAYOUT_VERSION}.safetensors"
        self.dense: dict = {}  # dense tensors (norms, biases) by checkpoint name
        self.stored = self._read()
        self.built: dict[str, dict] = {}

    def _read(self) -> dict[str, dict]:
        """name -> {field: tensor, "offset": float, "bits"/"group"/"gps": int}, or {} when the
        cache is absent or not usable (a warning says why); the dense tensors into `dense`."""
        import torch

        if not self.path.is_file():
            return {}
        try:
            f = PreparedFile(str(self.path), self.key)
            weights = {name: dict(zip(("offset", *_INTS), values)) for name, values in f.params.items()}
            for key in f.keys():
                t = torch.from_numpy(f.array(key))
                if f.dtype(key) == "BF16":
                    t = t.view(torch.bfloat16)
                if "/" in key:
                    name, field_ = key.rsplit("/", 1)
                    weights[name][field_] = t
                else:
                    self.dense[key] = t
            return weights
        except Exception as exc:  # a damaged file raises anything from I/O to header and JSON errors
            log.warning("prepared-weights cache %s is not usable (%s: %s); packing the weights again",
                        self.path, type(exc).__name__, exc)
            self.dense = {}
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

    def keep_dense(self, name: str, t) -> None:
        """Keep the model's dense tensor `name` (a norm or a bias, as loaded) for the next `save`."""
        self.dense[name] = t

    def save(self) -> None:
        """Write the cache when anything was packed in this load (every weight, stored or new, and
        the dense tensors kept). A folder that cannot be written is one warning; the model still
        runs."""
        from safetensors.torch import save_file

        if not self.built:
            return
        weights = {**self.stored, **self.built}
        tensors = {f"{name}/{k}": w[k].contiguous() for name, w in weights.items() for k in _FIELDS
                   if w.get(k) is not None}
        tensors.update({name: t.detach().contiguous() for name, t in self.dense.items()})
        params = {name: [w["offset"], *(w[k] for k in _INTS)] for name, w in weights.items()}
        meta = {"key": self.key, "layout": str(LAYOUT_VERSION), "luts": _LUTS, "params": json.dumps(params)}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            save_file(tensors, str(tmp), metadata=meta)
            os.replace(tmp, self.path)
            for old in self.path.parent.glob(f"{self.key}-v*.safetensors"):  # the same model's older layouts:
                if old != self.path:  # dead weight now (a process still mapping one keeps its pages)
                    old.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot write the prepared-weights cache %s (%s)", self.path, exc)


# the merges file's format (`merges_path`); bump when `tokenizer.tokenizer.sentencepiece_merges` changes
MERGES_VERSION = 1


def merges_path(path: str | os.PathLike) -> Path | None:
    """Where the SentencePiece merges of the GGUF file at `path` are kept
    (``<cache>/prepared/<sha256>-merges-v<MERGES_VERSION>.npy``:
    `tokenizer.tokenizer.cached_sentencepiece_merges`), or None when the file cannot be read (no
    cache then)."""
    from nextoken.catalog import cache_dir

    try:
        return cache_dir() / "prepared" / f"{file_key(path)}-merges-v{MERGES_VERSION}.npy"
    except OSError:
        return None


def content_key(path: str | os.PathLike) -> str:
    """The SHA-256 of a model file (`file_key`, remembered across starts), or for a Hugging Face
    folder the SHA-256 over its weight and JSON files' names and hashes: what names the model's
    bytes (the KV disk tier's namespaces, `kv_cache.disk`)."""
    path = str(path)
    if not os.path.isdir(path):
        return file_key(path)
    h = hashlib.sha256()
    for name in sorted(f for f in os.listdir(path) if f.endswith((".safetensors", ".json"))):
        h.update(f"{name}\0{file_key(os.path.join(path, name))}\n".encode())
    return h.hexdigest()
