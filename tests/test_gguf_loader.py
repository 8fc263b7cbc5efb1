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
        whole = f.tensor(name)
        assert torch.equal(f.tensor(name, chunk_rows=7), whole)
        assert torch.equal(f.tensor(name, torch.bfloat16, chunk_rows=5), whole.to(torch.bfloat16))
