"""``--quantization`` (`nextoken.loader.quantize`): a Hugging Face folder quantized at load holds
exactly the blocks the `gguf` package writes, so it runs like the GGUF file of the same model
with those blocks; the second start maps the prepared-weights cache instead of quantizing; the
errors name what is wrong."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nextoken import LLM
from nextoken.engine_args import EngineArgs
from nextoken.errors import InvalidRequest, ModelLoadError
from nextoken.loader import quantize
from nextoken.loader.gguf import GGUFFile
from nextoken.loader.hf import HFModelDir
from nextoken.runner.model_runner import ModelRunner
from tests.tiny_models import VOCAB_SIZE, OneSequence, tiny_hf_model, write_gguf

PROMPT = [5, 17, 200, 33, 41, 270, 90, 12, 7, 150]
Q8_TENSORS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
              "ffn_up.weight", "ffn_down.weight", "token_embd.weight", "output.weight")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """The same tiny qwen2 model as a float32 folder and as a GGUF file whose linear weights and
    embedding are Q8_0 (written by the `gguf` package)."""
    d = tmp_path_factory.mktemp("qload")
    hf = tiny_hf_model("qwen2", seed=4, vocab_size=-(-VOCAB_SIZE // 16) * 16)  # whole tiles: all codes
    hf.save_pretrained(d / "folder", safe_serialization=True)
    write_gguf(hf, d / "q8.gguf", "qwen2", quant={s: "Q8_0" for s in Q8_TENSORS})
    return str(d / "folder"), str(d / "q8.gguf"), hf


@pytest.mark.parametrize("fmt", ["q8_0", "q5_1"])
def test_blocks_are_the_gguf_packages(qwen2, monkeypatch, tmp_path, fmt):
    monkeypatch.setenv("NEXTOKEN_CACHE", str(tmp_path / "cache"))
    folder, _, hf = qwen2
    runner = ModelRunner(HFModelDir(folder), torch.bfloat16, quantization=fmt)
    assert f"quantized at load to {fmt}" in runner.plan.describe(runner.model)
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize as gguf_quantize

    qtype = GGMLQuantizationType[fmt.upper()]
    for ours, theirs in ((runner.model.layers[1].mlp.down_proj, hf.model.layers[1].mlp.down_proj),
                         (runner.model.lm_head, hf.lm_head)):
        w = theirs.weight.detach().float().numpy()
        want = dequantize(gguf_quantize(w, qtype), qtype)
        assert np.array_equal(ours.qweight.dequantize().float().numpy(), want)


def test_runs_like_the_gguf_file_with_those_blocks(qwen2, monkeypatch, tmp_path):
    """Same blocks, same plan: the same logits, prefill and decode, bit for bit."""
    monkeypatch.setenv("NEXTOKEN_CACHE", str(tmp_path / "cache"))
    folder, gguf_path, _ = qwen2
    a = OneSequence(ModelRunner(HFModelDir(folder), torch.bfloat16, quantization="q8_0"))
    b = OneSequence(ModelRunner(GGUFFile(gguf_path), torch.bfloat16))
    assert torch.equal(a.forward(PROMPT, all_logits=True), b.forward(PROMPT, all_logits=True))
    for t in (3, 99, 240, 18):
        assert torch.equal(a.forward([t]), b.forward([t]))


def test_second_start_maps_the_prepared_cache(qwen2, monkeypatch, tmp_path):
    monkeypatch.setenv("NEXTOKEN_CACHE", str(tmp_path / "cache"))
    folder, _, _ = qwen2
    first = OneSequence(ModelRunner(HFModelDir(folder), torch.bfloat16, quantization="q4_0", prepared_cache=True))
    files = list((tmp_path / "cache" / "prepared").glob("*.safetensors"))
    assert len(files) == 1
    calls = []
    real = quantize.quantize_rows
    monkeypatch.setattr(quantize, "quantize_rows", lambda *a: calls.append(a) or real(*a))
    second = OneSequence(ModelRunner(HFModelDir(folder), torch.bfloat16, quantization="q4_0", prepared_cache=True))
    assert calls == []  # nothing quantized: every block came from the cache
    assert torch.equal(first.forward(PROMPT), second.forward(PROMPT))
    # another format is another cache entry, never the q4_0 blocks
    ModelRunner(HFModelDir(folder), torch.bfloat16, quantization="q8_0", prepared_cache=True)
    assert calls and len(list((tmp_path / "cache" / "prepared").glob("*.safetensors"))) == 2


def test_errors_name_what_is_wrong(qwen2):
    folder, gguf_path, _ = qwen2
    with pytest.raises(ModelLoadError, match="is a GGUF file, whose tensors keep the formats"):
        LLM(gguf_path, quantization="q8_0", auto_pull=False)
    with pytest.raises(ModelLoadError, match="runs in bfloat16; --dtype float32 is the unquantized reference"):
        ModelRunner(HFModelDir(folder), torch.float32, quantization="q8_0")
    with pytest.raises(InvalidRequest, match="quantization 'q4_k' is not supported; choose from q8_0"):
        EngineArgs(model=folder, quantization="q4_k")
