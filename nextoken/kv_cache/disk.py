"""The prefix cache's disk tier: full KV blocks in files that outlive the process and are shared
by every process that opens the same directory (replicas, a restarted server).

Layout (``--kv-cache-dir DIR``, `DiskKVStore`)::

    DIR/<namespace>/identity.json        what the namespace is (model, dtypes, block size, shard)
    DIR/<namespace>/<k[:2]>/<k>.kv       one full block, k = its chain key in hex
    DIR/tmp/                             files being written (renamed into place when complete)

The *namespace* is the SHA-256 of the identity: the model file's SHA-256, the compute dtype, the
KV cache dtype, the block size, the tensor-parallel shard and the cache's shape. Keys and values
of another model, dtype or shard live in another folder and are never read. A block's *chain
key* is ``sha256(parent key, or the namespace, for the first block || its tokens as int32)``,
the first 16 bytes: it names the whole prefix up to and including the block, as the RAM prefix
cache's hash does (`block_pool.hash_block`), but stays the same across processes.

A block file is ``header || tokens || payload || sha256(all before)``; the header holds a magic,
the namespace, the key, the token count and the payload's size (`BLOCK_HEADER`). A read checks
all of it, and the tokens against the request's: a truncated, damaged or half-written file, or a
key collision, is skipped with one warning, counted (``errors``) and removed, never used. Writes
go to ``DIR/tmp`` and are renamed into place (``os.replace``, atomic on one file system), so a
reader sees a whole file or none; a process killed mid-write leaves only a temporary file, which
a later start deletes once it is an hour old.

Writes run on a background thread: the stepping thread only copies the block out of the cache
(`PagedKVCache.read_block`) and queues it, and a full queue drops the block rather than wait.
The directory's files are kept under ``--kv-cache-disk`` bytes, least recently used first: a read
sets a file's modification time, and the writer deletes the oldest files of every namespace
when the total passes the limit. A directory that cannot be written (read-only, full) turns the
writes off with one warning; reads and serving go on.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import weakref
from array import array
from pathlib import Path
from typing import Callable, Iterable

from nextoken.errors import InvalidRequest

log = logging.getLogger("nextoken.kv_cache")

FORMAT_VERSION = 1
MAGIC = b"NXKVBLK1"
BLOCK_HEADER = struct.Struct("<8s16s16sIQ")  # magic, namespace, key, number of tokens, payload bytes
DIGEST_BYTES = 32  # sha256 of everything before it
KEY_BYTES = 16
STALE_TMP_SECONDS = 3600
DEFAULT_DISK_BYTES = 8 << 30
MAX_PENDING_BYTES = 256 << 20  # blocks queued for writing; more are dropped, never waited for
MAX_KNOWN_KEYS = 1 << 20  # keys remembered as on disk (about 100 MiB of Python objects at most)


class BlockFileError(ValueError):
    """A block file that must not be used: truncated, damaged, or not the block asked for."""


def namespace_of(identity: dict) -> bytes:
    """16 bytes that name everything keys and values depend on (`identity`: JSON-able)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()[:KEY_BYTES]


def chain_key(namespace: bytes, parent: bytes | None, tokens: Iterable[int]) -> bytes:
    """The disk key of a full block: ``sha256(parent or namespace || tokens as int32)[:16]``."""
    h = hashlib.sha256(parent if parent is not None else namespace)
    h.update(array("i", tokens).tobytes())
    return h.digest()[:KEY_BYTES]


def salted_root(namespace: bytes, salt: str) -> bytes:
    """The parent a salted request's first block is chained to (`chain_key`), in place of the
    namespace: ``sha256(namespace || "cache_salt" || salt)[:16]`` (vLLM's ``cache_salt``)."""
    return hashlib.sha256(namespace + b"cache_salt\0" + salt.encode()).digest()[:KEY_BYTES]


def encode_block(namespace: bytes, key: bytes, tokens: tuple[int, ...], payload) -> list[bytes]:
    """A block file's bytes, as the pieces to write in order (`payload`: a bytes-like object)."""
    head = BLOCK_HEADER.pack(MAGIC, namespace, key, len(tokens), len(payload)) + array("i", tokens).tobytes()
    digest = hashlib.sha256(head)
    digest.update(payload)
    return [head, payload, digest.digest()]


def decode_block(data: bytearray, namespace: bytes, key: bytes, tokens: tuple[int, ...],
                 payload_bytes: int) -> memoryview:
    """The payload of the block file `data`, after every check; raises `BlockFileError` naming
    the first that fails (size, magic, namespace, key, tokens, checksum)."""
    head_len = BLOCK_HEADER.size + 4 * len(tokens)
    if len(data) != head_len + payload_bytes + DIGEST_BYTES:
        raise BlockFileError(f"{len(data)} bytes where {head_len + payload_bytes + DIGEST_BYTES} were expected "
                             "(truncated or another layout)")
    magic, ns, k, n, size = BLOCK_HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BlockFileError("not a nextoken KV block file (bad magic)")
    if ns != namespace or k != key:
        raise BlockFileError("it holds another model's or another prefix's block")
    if n != len(tokens) or size != payload_bytes or \
            data[BLOCK_HEADER.size : head_len] != array("i", tokens).tobytes():
        raise BlockFileError("its tokens are not the prefix asked for")
    view = memoryview(data)
    if hashlib.sha256(view[: head_len + payload_bytes]).digest() != bytes(view[head_len + payload_bytes :]):
        raise BlockFileError("checksum mismatch (the file is damaged)")
    return view[head_len : head_len + payload_bytes]


class DiskKVStore:
    """Full KV blocks of one namespace under `directory` (see the module docstring).

    capacity: most bytes of block files in `directory` (every namespace together); block_bytes:
    one block's payload. `stats` counts ``hits`` / ``misses`` (blocks looked up), ``bytes_read``,
    ``bytes_written``, ``blocks_written``, ``errors`` (bad files skipped, failed reads and
    writes) and ``dropped`` (blocks not written: queue full or writes off). Nothing raises: a
    directory that cannot be used leaves the store RAM-only (`writable` False) with a warning.
    """

    def __init__(self, directory: str | os.PathLike, capacity: int, identity: dict, block_bytes: int):
        self.directory = Path(directory).expanduser()
        self.capacity, self.block_bytes = capacity, block_bytes
        self.identity = {"format": FORMAT_VERSION, **identity}
        self.namespace = namespace_of(self.identity)
        self.root = self.directory / self.namespace.hex()
        self.file_bytes = BLOCK_HEADER.size + DIGEST_BYTES + block_bytes  # plus 4 bytes a token
        self.stats = dict.fromkeys(("hits", "misses", "bytes_read", "bytes_written", "blocks_written", "errors",
                                    "dropped"), 0)
        self.writable = True
        self._known: set[bytes] = set()  # keys on disk (written or read here)
        self._banned: set[bytes] = set()  # keys never to write (`discard`)
        self._warned: set[str] = set()
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0  # payload bytes queued
        self._lock = threading.Lock()
        self._size: int | None = None  # bytes of block files in the directory (the writer's estimate)
        self._writes_since_scan = 0
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            (self.directory / "tmp").mkdir(exist_ok=True)
            meta = self.root / "identity.json"
            if not meta.exists():
                self._atomic_write(meta, [json.dumps(self.identity, indent=1, sort_keys=True).encode()])
        except OSError as exc:
            self._stop_writing(exc)
        self._writer = threading.Thread(target=self._write_loop, name="nextoken-kv-disk", daemon=True)
        self._writer.start()
        _open_stores.add(self)

    # -- lookups (the stepping thread) -------------------------------------------------------
    def path(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[:2] / f"{h}.kv"

    def contains(self, key: bytes) -> bool:
        """Whether a file for `key` exists (it is checked when read)."""
        return key in self._known or self.path(key).is_file()

    def read(self, key: bytes, tokens: tuple[int, ...]) -> memoryview | None:
        """The payload of block `key` holding `tokens`, checked, or None (a miss, or a bad file:
        skipped, counted, removed)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                f.readinto(data)
        except FileNotFoundError:
            self.stats["misses"] += 1
            return None
        except OSError as exc:
            self._error("read", f"cannot read {path}: {exc}")
            return None
        try:
            payload = decode_block(data, self.namespace, key, tokens, self.block_bytes)
        except BlockFileError as exc:
            self._error("bad", f"skipped KV block file {path}: {exc}")
            self._unlink(path)
            return None
        try:
            os.utime(path)  # least recently used goes first
        except OSError:
            pass
        self._known.add(key)
        self.stats["hits"] += 1
        self.stats["bytes_read"] += len(data)
        return payload

    def offer(self, key: bytes, tokens: tuple[int, ...], copy_payload: Callable[[], object]) -> None:
        """Queue block `key` for writing unless it is on disk already, writes are off, or the
        queue is full. `copy_payload()` copies the block's bytes out of the cache now."""
        if key in self._known:
            return
        if len(self._known) > MAX_KNOWN_KEYS:  # a hint only: the writer checks the file anyway
            self._known.clear()
        if not self.writable or self._pending + self.block_bytes > MAX_PENDING_BYTES:
            self.stats["dropped"] += 1
            return
        self._known.add(key)
        with self._lock:
            self._pending += self.block_bytes
        self._queue.put((key, tokens, copy_payload()))

    def discard(self, key: bytes) -> None:
        """Block `key` must not be reused (its pass produced non-finite values): drop it from the
        queue and the directory."""
        self._banned.add(key)
        self._known.discard(key)
        self._unlink(self.path(key))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written (shutdown, tests), at most `timeout` seconds
        (None: no limit); whether the queue emptied."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._queue.all_tasks_done.wait(left)
        return True

    # -- writing (the writer thread) ----------------------------------------------------------
    def _write_loop(self) -> None:
        self._clean_tmp()
        while True:
            key, tokens, payload = self._queue.get()
            try:
                if self.writable:
                    self._write(key, tokens, payload)
            except Exception as exc:  # noqa: BLE001 - the writer must outlive any one block
                self._error("write", f"KV block write failed: {type(exc).__name__}: {exc}")
            finally:
                with self._lock:
                    self._pending -= self.block_bytes
                self._queue.task_done()

    def _write(self, key: bytes, tokens: tuple[int, ...], payload) -> None:
        path = self.path(key)
        size = self.file_bytes + 4 * len(tokens)
        if path.exists() or key in self._banned:
            return
        if size > self.capacity:
            self.stats["dropped"] += 1
            self._known.discard(key)
            return
        try:
            path.parent.mkdir(exist_ok=True)
            self._atomic_write(path, encode_block(self.namespace, key, tokens, payload))
        except OSError as exc:
            self._known.discard(key)
            if exc.errno in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT):
                self._stop_writing(exc)
            else:
                self._error("write", f"cannot write {path}: {exc}")
            return
        self.stats["blocks_written"] += 1
        self.stats["bytes_written"] += size
        self._writes_since_scan += 1
        if self._size is None or self._writes_since_scan >= 256:  # other processes write here too
            self._size = self._scan_total()
            self._writes_since_scan = 0
        else:
            self._size += size
        if self._size > self.capacity:
            self._evict()

    def _atomic_write(self, path: Path, pieces: list) -> None:
        tmp = self.directory / "tmp" / f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                for piece in pieces:
                    f.write(piece)
            os.replace(tmp, path)
        except BaseException:
            self._unlink(tmp)
            raise

    def _block_files(self) -> list[os.DirEntry]:
        """Every block file of every namespace in the directory."""
        out = []
        for ns in _scandir(self.directory):
            if ns.is_dir() and ns.name != "tmp":
                for sub in _scandir(ns.path):
                    if sub.is_dir():
                        out += [e for e in _scandir(sub.path) if e.name.endswith(".kv")]
        return out

    def _scan_total(self) -> int:
        return sum(_stat(e)[1] for e in self._block_files())

    def _evict(self) -> None:
        """Delete the least recently used block files until they take 90% of the capacity."""
        files = sorted((_stat(e), e.path) for e in self._block_files())
        total = sum(size for (_, size), _ in files)
        for (_, size), path in files:
            if total <= 0.9 * self.capacity:
                break
            if self._unlink(Path(path)):
                total -= size
                if Path(path).parent.parent == self.root:
                    self._known.discard(bytes.fromhex(Path(path).stem))
        self._size = total

    def _clean_tmp(self) -> None:
        """Delete temporary files a killed process left (an hour old: a live write takes less)."""
        now = time.time()
        for e in _scandir(self.directory / "tmp"):
            if now - _stat(e)[0] > STALE_TMP_SECONDS:
                self._unlink(Path(e.path))

    # -- faults ---------------------------------------------------------------------------------
    def _stop_writing(self, exc: OSError) -> None:
        self.writable = False
        self.stats["errors"] += 1
        log.warning("KV disk tier: %s; blocks are no longer written to %s, serving goes on from RAM", exc,
                    self.directory)

    def _error(self, kind: str, message: str) -> None:
        """Count a fault; warn the first time of each kind, then log at debug level."""
        self.stats["errors"] += 1
        log.log(logging.DEBUG if kind in self._warned else logging.WARNING, "KV disk tier: %s", message)
        self._warned.add(kind)

    @staticmethod
    def _unlink(path: Path) -> bool:
        try:
            path.unlink()
            return True
        except OSError:
            return False


_open_stores: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    """Blocks still queued at exit are written (10 s at most a store): a restart finds them."""
    for store in list(_open_stores):
        store.flush(10.0)


def _scandir(path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _stat(entry: os.DirEntry) -> tuple[float, int]:
    """(modification time, size) of a directory entry; (0, 0) when it went away."""
    try:
        st = entry.stat()
        return st.st_mtime, st.st_size
    except OSError:
        return 0.0, 0


class DiskTier:
    """A `DiskKVStore` bound to the cache tensors it copies blocks out of and into
    (`PagedKVCache.read_block` / `write_block`); the `KVCacheManager` drives it. For a model
    with sliding-window layers, `sliding` stores their part of each block (`SlidingKVCache`'s
    blocks) in a namespace of its own, under the same keys: a block's full-attention part can
    be on disk without it (a long pass that kept no block of those layers for it)."""

    def __init__(self, store: DiskKVStore, kv, sliding: DiskKVStore | None = None):
        self.store, self.kv, self.sliding = store, kv, sliding

    @property
    def stores(self) -> list[DiskKVStore]:
        return [s for s in (self.store, self.sliding) if s is not None]

    def offer(self, key: bytes, tokens: tuple[int, ...], block_id: int, sliding_id: int | None = None) -> None:
        """Queue block `block_id` under `key` (and the sliding-window layers' block
        `sliding_id`, when given), copied now."""
        self.store.offer(key, tokens, lambda: self.kv.read_block(block_id))
        if sliding_id is not None and self.sliding is not None:
            self.sliding.offer(key, tokens, lambda: self.kv.sliding.read_block(sliding_id))

    def fetch(self, key: bytes, tokens: tuple[int, ...], sliding: bool = False):
        """The checked payload of block `key` (with `sliding`: its sliding-window layers'
        part), or None (not on disk, or a bad file)."""
        store = self.sliding if sliding else self.store
        if not store.contains(key):
            store.stats["misses"] += 1
            return None
        return store.read(key, tokens)

    def fill(self, block_id: int, payload, sliding: bool = False) -> None:
        (self.kv.sliding if sliding else self.kv).write_block(block_id, payload)


def open_disk_tier(cache, runner, model_key: str) -> DiskTier | None:
    """The disk tier `cache` (`CacheConfig`: ``disk_dir``, ``disk_bytes``) asks for over
    `runner`'s KV cache, or None: none asked for, or prefix caching is off. `model_key`: the
    SHA-256 of the model's bytes (`loader.prepared.content_key`). The identity holds everything
    the keys and values depend on: the model, the compute and cache dtypes, the block size, the
    shard, the cache's shape and the kernels the plan chose."""
    if not cache.disk_dir or not cache.enable_prefix_caching:
        return None
    kv, plan, cfg = runner.kv, runner.plan, runner.model.config
    tp = runner.tp
    if tp is not None:
        raise InvalidRequest("the KV disk tier (--kv-cache-dir, --kv-cache-disk) is not available with tensor "
                             "parallelism yet", "kv_cache_dir")
    kv_format = cache.cache_dtype + ("+hadamard-keys" if kv.quantized else "")  # (blocks of older int8 keys unrotated)
    identity = {"model": model_key, "dtype": str(runner.dtype), "kv_cache_dtype": kv_format,
                "block_size": cache.block_size, "shard": [tp.rank, tp.size] if tp is not None else [0, 1],
                "layers": len(cfg.full_layers), "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                "plan": {"codes": plan.codes, "torch_int4": plan.torch_int4, "dense_weights": plan.dense_weights,
                         "attention": plan.attention, "native_decode": plan.native_decode}}
    store = DiskKVStore(cache.disk_dir, cache.disk_bytes or DEFAULT_DISK_BYTES, identity, kv.block_bytes)
    sliding = None
    if kv.sliding is not None:  # the sliding-window layers' parts: another namespace, the same keys
        sliding = DiskKVStore(cache.disk_dir, cache.disk_bytes or DEFAULT_DISK_BYTES,
                              {**identity, "part": "sliding-window layers", "layers": len(cfg.sliding_layers)},
                              kv.sliding.block_bytes)
    log.info("KV disk tier: %s (namespace %s, at most %.1f GiB, %d KiB a block%s)%s", store.directory,
             store.namespace.hex(), store.capacity / 2**30, kv.block_bytes // 1024,
             f"; the sliding-window layers' {kv.sliding.block_bytes // 1024} KiB in {sliding.namespace.hex()}"
             if sliding is not None else "", "" if store.writable else "; read-only")
    return DiskTier(store, kv, sliding)
