"""GGUF metadata -> ModelConfig, and the errors for bad files."""

from __future__ import annotations

import pytest

from nextoken.errors import ModelLoadError
from nextoken.loader.gguf import GGUFFile, read_model_config
from tests.tiny_models import VOCAB_SIZE


def test_config_from_metadata(tiny_gguf):
    path, hf = tiny_gguf["qwen2"]
    cfg = read_model_config(GGUFFile(path))
    c = hf.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (
        "qwen2", c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads)
    assert cfg.vocab_size == VOCAB_SIZE and cfg.head_dim == 16 and cfg.intermediate_size == c.intermediate_size
    assert cfg.attention_bias and not cfg.tie_word_embeddings
    assert not read_model_config(GGUFFile(tiny_gguf["llama"][0])).attention_bias


def test_truncated_file_is_reported(tiny_gguf, tmp_path):
    data = tiny_gguf["llama"][0].read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match="truncated|corrupt"):
        GGUFFile(bad)


def test_not_gguf_is_reported(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"hello, this is not a model" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        GGUFFile(bad)


def test_missing_file_is_reported(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        GGUFFile(tmp_path / "nope.gguf")


def test_missing_tensor_names_itself(tiny_gguf):
    f = GGUFFile(tiny_gguf["llama"][0])
    with pytest.raises(ModelLoadError, match="blk.9.attn_q.weight"):
        f.tensor("blk.9.attn_q.weight")


def test_chunked_dequantization_equals_whole(tmp_path):
    """Row-chunked loading (what large tensors use) gives the same tensor as one piece."""
    import torch

    from tests.tiny_models import tiny_hf_model, write_gguf

    path = tmp_path / "q.gguf"
    write_gguf(tiny_hf_model("llama", seed=2), path, "llama", quant={"ffn_up.weight": "Q4_1"})
    f = GGUFFile(path)
    for name in ("blk.0.ffn_up.weight", "token_embd.weight"):
        whole = f.tensor(name, chunk_rows=1 << 30)
        assert torch.equal(f.tensor(name), whole)  # (pieces of `host_memory.SCRATCH_ELEMENTS` values)
        assert torch.equal(f.tensor(name, chunk_rows=7), whole)
        assert torch.equal(f.tensor(name, torch.bfloat16, chunk_rows=5), whole.to(torch.bfloat16))


def test_header_reader_equals_the_gguf_package(tiny_gguf, smollm2_path, tmp_path):
    """Our one-pass header reader gives exactly what ``gguf.GGUFReader`` gives (every metadata
    value as ``contents()`` returns it, every tensor's type, shape, offset and size) on the tiny
    files of every architecture, SmolLM2's real file, and a file with every metadata value type
    (scalars of each width, bools, strings, arrays of numbers, of bools and of strings)."""
    import gguf

    from nextoken.loader.gguf import read_header_reference
    from nextoken.loader.gguf_header import read_header
    from tests.helpers.gguf_reader import plain_arrays

    typed = tmp_path / "typed.gguf"
    w = gguf.GGUFWriter(str(typed), "llama")
    w.add_uint8("t.u8", 200), w.add_int8("t.i8", -5), w.add_uint16("t.u16", 60000), w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000), w.add_int32("t.i32", -7), w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5), w.add_int64("t.i64", -(2**40)), w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True), w.add_string("t.str", "héllo ✓"), w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5]), w.add_array("t.strs", ["a", "", "ü" * 40]), w.add_array("t.bools", [True, False])
    import numpy as np

    w.add_tensor("x", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    paths = [p for p, _ in tiny_gguf.values()] + [smollm2_path, typed]
    for path in paths:
        fields, tensors = read_header(str(path))
        with plain_arrays():  # (the same reader, faster: tests/helpers/gguf_reader.py)
            ref_fields, ref_tensors = read_header_reference(str(path))
        assert fields == ref_fields and list(fields) == list(ref_fields), path
        assert tensors == ref_tensors, path
    fields, _ = read_header(str(typed))
    assert (fields["t.u64"], fields["t.f64"], fields["t.strs"][2]) == (2**63 + 5, 1e-300, "ü" * 40)


def test_header_reader_refuses_what_it_does_not_read(tiny_gguf, tmp_path):
    """A big-endian version field or a damaged value type is a `GGUFHeaderError` (GGUFFile then
    tries the gguf package's reader, and reports a file neither reads as not readable)."""
    from nextoken.loader.gguf_header import GGUFHeaderError, read_header

    data = bytearray(tiny_gguf["llama"][0].read_bytes())
    swapped = tmp_path / "be.gguf"
    swapped.write_bytes(bytes(data[:4]) + (3).to_bytes(4, "big") + bytes(data[8:]))
    with pytest.raises(GGUFHeaderError, match="version"):
        read_header(str(swapped))
    key_len = int.from_bytes(data[24:32], "little")  # first key: u64 length, bytes, then its u32 type
    data[32 + key_len : 36 + key_len] = (77).to_bytes(4, "little")
    bad = tmp_path / "bad-type.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFHeaderError, match="value type 77"):
        read_header(str(bad))
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        GGUFFile(bad)
