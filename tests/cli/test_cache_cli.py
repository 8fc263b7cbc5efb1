"""``nextoken cache ls | prune`` over a cache folder made for the test (``$NEXTOKEN_CACHE``)."""

from __future__ import annotations

import json
import os
import time

import pytest

from nextoken.cli import main
from nextoken.kv_cache.disk import DiskKVStore, chain_key
from nextoken.loader.prepared import LAYOUT_VERSION, MERGES_VERSION


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """A cache with one pulled model, its current prepared weights, an old layout's, its
    tokenizer's merges in the current format and an old one's, a stale kernel build, KV blocks of
    one namespace and a temporary file a killed writer left."""
    monkeypatch.setenv("NEXTOKEN_CACHE", str(tmp_path))
    (tmp_path / "models").mkdir()
    model = tmp_path / "models" / "tiny.gguf"
    model.write_bytes(b"GGUF" + bytes(1000))
    model.with_suffix(".gguf.verified").write_text("ok")
    sha = "ab" * 32
    (tmp_path / "prepared" / "keys").mkdir(parents=True)
    (tmp_path / "prepared" / "keys" / "m.json").write_text(json.dumps({"path": str(model), "sha256": sha,
                                                                       "identity": [0]}))
    (tmp_path / "prepared" / f"{sha}-v{LAYOUT_VERSION}.safetensors").write_bytes(bytes(300))
    (tmp_path / "prepared" / f"{sha}-v{LAYOUT_VERSION - 1}.safetensors").write_bytes(bytes(200))
    (tmp_path / "prepared" / f"{sha}-merges-v{MERGES_VERSION}.npy").write_bytes(bytes(40))
    (tmp_path / "prepared" / f"{sha}-merges-v{MERGES_VERSION - 1}.npy").write_bytes(bytes(30))
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "qmatmul-0000000000000000.so").write_bytes(bytes(50))
    store = DiskKVStore(tmp_path / "kv", 1 << 20, {"model": sha, "dtype": "torch.bfloat16"}, 100)
    parent = None
    for i in range(3):
        parent = chain_key(store.namespace, parent, (i,))
        store.offer(parent, (i,), lambda: bytes(100))
    store.flush()
    old = time.time() - 10 * 86400
    first = store.path(chain_key(store.namespace, None, (0,)))
    os.utime(first, (old, old))
    stale_tmp = tmp_path / "kv" / "tmp" / "x.kv.1.2.tmp"
    stale_tmp.write_bytes(bytes(10))
    os.utime(stale_tmp, (old, old))
    return tmp_path, store


def ls(capsys) -> list[dict]:
    capsys.readouterr()
    assert main(["cache", "ls", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["entries"]


def test_ls_names_every_kind_with_sizes(cache, capsys):
    root, store = cache
    found = ls(capsys)
    kinds = {(e["kind"], e["stale"]) for e in found}
    assert kinds == {("models", False), ("prepared", False), ("prepared", True), ("kernels", True), ("kv", False),
                     ("kv", True)}
    kv = next(e for e in found if e["kind"] == "kv" and not e["stale"])
    assert kv["name"].startswith("tiny.gguf") and kv["detail"].startswith("3 blocks; bfloat16")
    assert kv["bytes"] == sum(f.stat().st_size for f in store.root.rglob("*") if f.is_file())
    assert main(["cache", "ls"]) == 0
    text = capsys.readouterr().out
    assert "models: 1 entries" in text and "stale" in text and "total:" in text


def test_prune_removes_the_stale_then_what_the_flags_name(cache, capsys):
    root, store = cache
    assert main(["cache", "prune", "--dry-run"]) == 0
    assert "would remove" in capsys.readouterr().out
    assert len(ls(capsys)) == 8
    assert main(["cache", "prune"]) == 0
    left = ls(capsys)
    assert not any(e["stale"] for e in left) and {e["kind"] for e in left} == {"models", "prepared", "kv"}
    assert sorted(os.path.basename(e["path"]) for e in left if e["kind"] == "prepared") == \
        [f"{'ab' * 32}-merges-v{MERGES_VERSION}.npy", f"{'ab' * 32}-v{LAYOUT_VERSION}.safetensors"]
    assert main(["cache", "prune", "--kv", "--older-than", "5"]) == 0  # one block unused for 10 days
    assert len(list(store.root.glob("*/*.kv"))) == 2
    assert main(["cache", "prune", "--kv", "--prepared", "--model", "tiny"]) == 0
    assert ls(capsys) == [] and not (root / "models" / "tiny.gguf.verified").exists()


def test_prune_of_a_model_not_pulled_is_an_error(cache, capsys):
    assert main(["cache", "prune", "--model", "nope"]) == 1
    assert "no pulled model named nope" in capsys.readouterr().err
