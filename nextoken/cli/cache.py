"""``nextoken cache ls | prune``: what the user's cache holds, and removing what is not needed.

The cache (`catalog.cache_dir`: ``$NEXTOKEN_CACHE``, else ``~/.cache/nextoken``) holds four
kinds of files:

- ``models/``: pulled catalog models (``<name>.gguf`` and its ``.verified`` marker);
- ``prepared/``: GGUF weights repacked for our kernels (`loader.prepared`), one file per model
  file's SHA-256 and layout version, and a SentencePiece vocabulary's merges (``-merges-v*.npy``);
  ``prepared/keys/`` remembers each model path's SHA-256;
- ``kernels/``: our C kernels compiled for this CPU and compiler (`kernels.library_path`);
- ``kv/`` (and any ``--kv-cache-dir``): the prefix cache's disk tier (`kv_cache.disk`), one
  folder per namespace with its ``identity.json``.

``prune`` alone removes what nothing here can use any more: kernel builds of other sources,
flags or compilers, prepared weights of another layout or of a model file no longer present, and
temporary files a killed writer left. ``--kv`` also removes KV blocks (with ``--older-than``,
those unused for that many days), ``--prepared`` every prepared file, ``--model NAME`` a pulled
model. ``--dry-run`` lists what would go. torch-free.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from nextoken.errors import InvalidRequest

KINDS = ("models", "prepared", "kernels", "kv")


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _last_used(path: Path) -> float:
    if path.is_file():
        return path.stat().st_mtime
    return max((f.stat().st_mtime for f in path.rglob("*") if f.is_file()), default=path.stat().st_mtime)


def _known_models(root: Path) -> dict[str, str]:
    """Model SHA-256 -> the path it was read from (the prepared cache's memos)."""
    out = {}
    for memo in (root / "prepared" / "keys").glob("*.json"):
        try:
            m = json.loads(memo.read_text())
            out[m["sha256"]] = m["path"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def _current_kernels() -> set[str]:
    """File names of the kernel builds this installation would load (native and portable)."""
    from nextoken import kernels
    from nextoken.kernels import toolchain

    compiler = toolchain.compiler()
    if compiler is None:
        return set()
    names = {kernels.host(p.stem) for p in Path(kernels.__file__).parent.glob("*.c")}
    return {kernels.library_path(n, flags, compiler).name for n in names
            for flags in (kernels.FLAGS, kernels.PORTABLE_FLAGS)}


def entries(root: Path, kv_dirs: list[Path]) -> list[dict]:
    """Everything in the cache at `root` and the KV directories `kv_dirs`, one dict each:
    ``kind``, ``path``, ``name``, ``bytes``, ``last_used`` (Unix time), ``stale`` (nothing here
    can use it), and ``detail``."""
    from nextoken.loader.prepared import LAYOUT_VERSION, MERGES_VERSION

    out: list[dict] = []
    models = _known_models(root)

    def add(kind, path: Path, name, stale=False, detail=""):
        out.append({"kind": kind, "path": str(path), "name": name, "bytes": _size(path),
                    "last_used": _last_used(path), "stale": stale, "detail": detail})

    for f in sorted((root / "models").glob("*.gguf")):
        add("models", f, f.stem, detail="verified" if f.with_suffix(".gguf.verified").exists() else "not verified")
    for f in sorted(p for p in (root / "models").glob("*") if p.is_dir() and not p.name.endswith(".unpacking")):
        add("models", f, f.name, detail="verified folder" if (f.parent / f"{f.name}.verified").exists()
            else "folder, not verified")
    # prepared weights, and a SentencePiece vocabulary's merges: <sha256><sep><version>, stale at another
    # version or without their model file
    for pattern, sep, version, older, current_detail in (("*.safetensors", "-v", LAYOUT_VERSION, "older layout", ""),
                                                          ("*-merges-v*.npy", "-merges-v", MERGES_VERSION,
                                                           "older format", "tokenizer merges")):
        for f in sorted((root / "prepared").glob(pattern)):
            sha, _, found = f.stem.rpartition(sep)
            source = models.get(sha)
            present = source is not None and os.path.exists(source)
            why = older if found != str(version) else current_detail if present else "its model file is gone"
            add("prepared", f, os.path.basename(source) if source else sha[:16], found != str(version) or not present,
                why)
    current = _current_kernels()
    for f in sorted((root / "kernels").glob("*.so")):
        add("kernels", f, f.name, bool(current) and f.name not in current,
            "current" if f.name in current else "another source, flags or compiler")
    for d in kv_dirs:
        for ns in sorted(p for p in d.glob("*") if p.is_dir() and p.name != "tmp"):
            try:
                ident = json.loads((ns / "identity.json").read_text())
            except (OSError, ValueError):
                ident = {}
            model = models.get(ident.get("model", ""), ident.get("model", "?")[:16])
            blocks = sum(1 for _ in ns.glob("*/*.kv"))
            detail = (f"{blocks} blocks; {ident.get('dtype', '?').removeprefix('torch.')}, KV "
                      f"{ident.get('kv_cache_dtype', '?')}, block {ident.get('block_size', '?')}, shard "
                      f"{'/'.join(map(str, ident.get('shard', ['?'])))}")
            add("kv", ns, f"{os.path.basename(model)} ({ns.name[:8]})", False, detail)
        tmp = d / "tmp"
        for f in sorted(tmp.glob("*.tmp")) if tmp.is_dir() else []:
            add("kv", f, f.name, time.time() - f.stat().st_mtime > 3600, "a write in progress, or left by a killed one")
    return out


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _kv_dirs(root: Path, extra: list[str] | None) -> list[Path]:
    dirs = [root / "kv"] + [Path(d).expanduser() for d in extra or []]
    return [d for i, d in enumerate(dirs) if d not in dirs[:i]]


def cmd_cache(a) -> int:
    from nextoken.catalog import cache_dir

    root = cache_dir()
    found = entries(root, _kv_dirs(root, a.kv_cache_dir))
    if a.cache_command == "ls":
        return _print(found, root, a.json)
    return _prune(found, a)


def _print(found: list[dict], root: Path, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"cache": str(root), "entries": found}, indent=1))
        return 0
    print(f"cache: {root}")
    for kind in KINDS:
        mine = [e for e in found if e["kind"] == kind]
        total = sum(e["bytes"] for e in mine)
        print(f"\n{kind}: {len(mine)} entries, {_human(total)}")
        for e in mine:
            used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["last_used"]))
            flag = "  stale" if e["stale"] else ""
            print(f"  {e['name'][:48]:<48} {_human(e['bytes']):>10}  {used}  {e['detail']}{flag}")
    print(f"\ntotal: {_human(sum(e['bytes'] for e in found))}")
    return 0


def _prune(found: list[dict], a) -> int:
    cutoff = time.time() - a.older_than * 86400 if a.older_than is not None else None
    models = set(a.model or [])
    unknown = models - {e["name"] for e in found if e["kind"] == "models"}
    if unknown:
        raise InvalidRequest(f"no pulled model named {', '.join(sorted(unknown))} (see `nextoken cache ls`)", "model")

    def goes(e: dict) -> bool:
        if e["kind"] == "models":
            return e["name"] in models
        if e["kind"] == "kv" and a.kv and not e["path"].endswith(".tmp"):
            return cutoff is None
        if e["kind"] == "prepared" and a.prepared:
            return True
        return e["stale"]

    gone = [e for e in found if goes(e)]
    if a.kv and cutoff is not None:  # block by block: those unused since the cutoff
        for ns in [e for e in found if e["kind"] == "kv" and not e["path"].endswith(".tmp")]:
            gone += [{"kind": "kv", "path": str(f), "bytes": f.stat().st_size}
                     for f in Path(ns["path"]).glob("*/*.kv") if f.stat().st_mtime < cutoff]
    for e in gone:
        print(f"{'would remove' if a.dry_run else 'removed'} {e['kind']}: {e['path']} ({_human(e['bytes'])})")
        if not a.dry_run:
            _remove(Path(e["path"]))
    verb = "would free" if a.dry_run else "freed"
    print(f"{verb} {_human(sum(e['bytes'] for e in gone))} in {len(gone)} entries")
    return 0


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
        (path.parent / f"{path.name}.verified").unlink(missing_ok=True)  # a model folder's marker
        return
    extra = {".gguf": path.with_suffix(".gguf.verified"), ".so": path.with_name(path.name + ".lock")}  # markers
    for p in (path, extra[path.suffix]) if path.suffix in extra else (path,):
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def add_parser(sub) -> None:
    """The ``cache`` command and its ``ls`` and ``prune`` subcommands."""
    p = sub.add_parser("cache", help="list or prune the user's cache (models, prepared weights, kernels, KV blocks)")
    csub = p.add_subparsers(dest="cache_command", required=True)
    for name, text in (("ls", "list every entry with its size and when it was last used"),
                       ("prune", "remove stale entries (and with flags, KV blocks, prepared weights, models)")):
        q = csub.add_parser(name, help=text)
        q.add_argument("--kv-cache-dir", action="append", metavar="DIR",
                       help="also a KV disk tier directory outside the cache (repeatable)")
        if name == "ls":
            q.add_argument("--json", action="store_true", help="print the entries as JSON")
            continue
        q.add_argument("--kv", action="store_true", help="also remove KV blocks (every namespace)")
        q.add_argument("--older-than", type=float, metavar="DAYS", help="with --kv: only blocks unused for DAYS")
        q.add_argument("--prepared", action="store_true", help="also remove every prepared-weights file")
        q.add_argument("--model", action="append", metavar="NAME", help="also remove this pulled model (repeatable)")
        q.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
