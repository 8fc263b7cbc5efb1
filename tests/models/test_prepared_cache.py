"""The prepared-weights cache (`nextoken.loader.prepared`): a later load maps the codes a first
load packed, and gets exactly the weights packing gives; a cache that is stale, damaged or
under another key is never used as is; ``prepared_cache=False`` writes nothing."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from nextoken.loader.gguf import GGUFFile
from nextoken.loader.prepared import LAYOUT_VERSION, PreparedWeights, file_key
from nextoken.runner.model_runner import ModelRunner
from tests.tiny_models import tiny_hf_model, write_gguf

QUANT = {"attn_q.weight": "Q4_0", "attn_k.weight": "Q8_0", "attn_v.weight": "Q4_1", "attn_output.weight": "Q5_0",
         "ffn_gate.weight": "Q4_1", "ffn_up.weight": "Q8_0", "ffn_down.weight": "Q4_0", "token_embd.weight": "Q8_0"}


@pytest.fixture
def model_file(tmp_path, monkeypatch):
    monkeypatch.setenv("NEXTOKEN_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny-llama.gguf"
    write_gguf(tiny_hf_model("llama", seed=4), path, "llama", quant=QUANT)
    return path


def codes_of(runner) -> dict[str, tuple]:
    out = {}
    for name, m in runner.model.named_modules():
        qw = getattr(m, "qweight", None)
        if qw is not None:
            out[name] = (qw.codes, qw.scales, qw.mins, qw.scale_sup, qw.min_sup, qw.offset, qw.bits, qw.group, qw.gps)
    return out


def same_codes(a: dict, b: dict) -> bool:
    def eq(x, y):
        return torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y

    return a.keys() == b.keys() and all(all(eq(x, y) for x, y in zip(a[k], b[k])) for k in a)


def cache_file(path):
    from nextoken.catalog import cache_dir

    return cache_dir() / "prepared" / f"{file_key(path)}-v{LAYOUT_VERSION}.safetensors"


def test_second_load_maps_the_packed_codes(model_file):
    packed = ModelRunner(GGUFFile(model_file), torch.bfloat16, prepared_cache=True)
    assert packed.plan.codes and len(codes_of(packed)) >= 14  # 7 projections x 2 layers, and the embedding
    assert cache_file(model_file).is_file()
    again = PreparedWeights(str(model_file))
    assert len(again.stored) >= len(codes_of(packed)) - 1  # every codes weight (a tied head shares the embedding's)
    mapped = ModelRunner(GGUFFile(model_file), torch.bfloat16, prepared_cache=True)
    assert same_codes(codes_of(mapped), codes_of(packed))
    plain = ModelRunner(GGUFFile(model_file), torch.bfloat16, prepared_cache=False)
    assert same_codes(codes_of(plain), codes_of(packed))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "other key", "other lut tables", "wrong shape"])
def test_unusable_cache_is_rebuilt(model_file, damage, caplog):
    first = ModelRunner(GGUFFile(model_file), torch.bfloat16, prepared_cache=True)
    f = cache_file(model_file)
    data = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        f.write_bytes(b"\0" * len(data))
    else:
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(str(f), framework="pt") as sf:
            meta, tensors = sf.metadata(), {k: sf.get_tensor(k).clone() for k in sf.keys()}
        if damage == "other key":  # a cache written for other bytes, renamed to this file's key
            meta["key"] = "0" * 64
        elif damage == "other lut tables":  # packed by a version whose tables put the values elsewhere
            meta["luts"] = meta["luts"].replace("-43", "-44")
        else:  # a weight of other sizes under the right key
            name = next(k for k in tensors if k.endswith("/scales"))
            tensors[name] = tensors[name][:1].contiguous()
        save_file(tensors, str(f), metadata=meta)
    with caplog.at_level(logging.WARNING, logger="nextoken.loader.prepared"):
        again = ModelRunner(GGUFFile(model_file), torch.bfloat16, prepared_cache=True)
    assert "packing the weights again" in caplog.text
    assert same_codes(codes_of(again), codes_of(first))
    assert PreparedWeights(str(model_file)).stored  # rewritten, usable again


def test_a_changed_model_file_gets_its_own_cache(model_file, tmp_path):
    ModelRunner(GGUFFile(model_file), torch.bfloat16, prepared_cache=True)
    other = tmp_path / "tiny-llama-2.gguf"
    write_gguf(tiny_hf_model("llama", seed=5), other, "llama", quant=QUANT)
    runner = ModelRunner(GGUFFile(other), torch.bfloat16, prepared_cache=True)
    plain = ModelRunner(GGUFFile(other), torch.bfloat16, prepared_cache=False)
    assert same_codes(codes_of(runner), codes_of(plain))
    assert cache_file(other) != cache_file(model_file) and cache_file(other).is_file()


def test_a_new_layout_replaces_the_older_ones_file(model_file):
    """A cache of an earlier `LAYOUT_VERSION` is not read (its name carries the version) and, once
    the current one is written, removed: an upgrade leaves no dead copy of the model behind."""
    old = cache_file(model_file).with_name(f"{file_key(model_file)}-v{LAYOUT_VERSION - 1}.safetensors")
    old.parent.mkdir(parents=True, exist_ok=True)
    old.write_bytes(b"an earlier layout")
    ModelRunner(GGUFFile(model_file), torch.bfloat16, prepared_cache=True)
    assert cache_file(model_file).is_file() and not old.exists()


def test_off_writes_nothing(model_file):
    ModelRunner(GGUFFile(model_file), torch.bfloat16, prepared_cache=False)
    assert not cache_file(model_file).exists()


def test_the_key_is_remembered_for_the_files_identity(model_file, monkeypatch):
    """A later start takes the remembered SHA-256 while the file is unchanged (same inode, size,
    mtime and ctime) and hashes again after any write, a touch, or a damaged memo."""
    import hashlib

    from nextoken.loader import prepared

    def sha(path):
        return hashlib.sha256(path.read_bytes()).hexdigest()

    def fresh_key():  # as a new process: nothing kept in memory
        prepared._keys.clear()
        return file_key(model_file)

    assert fresh_key() == sha(model_file)
    hashed = []
    real_hash = prepared._hash
    monkeypatch.setattr(prepared, "_hash", lambda p: hashed.append(p) or real_hash(p))
    assert fresh_key() == sha(model_file) and hashed == []  # remembered
    with open(model_file, "ab") as fh:  # a write: other size and times
        fh.write(b"\0")
    assert fresh_key() == sha(model_file) and len(hashed) == 1
    assert fresh_key() == sha(model_file) and len(hashed) == 1  # remembered again
    os.utime(model_file)  # a touch: same bytes, other times
    assert fresh_key() == sha(model_file) and len(hashed) == 2
    prepared._memo_path(os.path.realpath(model_file)).write_text("{not json")
    assert fresh_key() == sha(model_file) and len(hashed) == 3
