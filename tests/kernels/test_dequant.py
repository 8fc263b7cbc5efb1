"""Our PyTorch de-quantization against `gguf.quants.dequantize` (the gguf package's numpy code)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from nextoken.layers.quantization.ggml import BLOCK_FORMATS, dequantize
from tests.helpers.blocks import random_blocks

# byte offsets of the float16 scale fields in each block (random bytes there could be NaN/inf)


@pytest.mark.parametrize("type_name", sorted(BLOCK_FORMATS))
def test_block_formats_equal_gguf_reference(type_name):
    raw = random_blocks(type_name, 96, seed=len(type_name)).reshape(8, -1)  # 8 rows of 12 blocks
    qtype = gguf.GGMLQuantizationType[type_name]
    expected = gguf.quants.dequantize(raw, qtype)
    got = dequantize(torch.from_numpy(raw), type_name, expected.shape)
    np.testing.assert_array_equal(got.numpy(), expected)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_quantize_roundtrip_is_close(type_name):
    """Real-valued weights quantized by gguf come back within the format's step size."""
    x = np.random.default_rng(0).normal(size=(4, 256)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[type_name]
    got = dequantize(torch.from_numpy(gguf.quants.quantize(x, qtype)), type_name, x.shape).numpy()
    step = {"Q8_0": 0.03, "Q5_0": 0.15, "Q5_1": 0.15, "Q4_0": 0.3, "Q4_1": 0.3}[type_name]
    assert np.abs(got - x).max() < step


@pytest.mark.parametrize("dtype,np_dtype", [("F16", np.float16), ("F32", np.float32)])
def test_float_types(dtype, np_dtype):
    x = np.random.default_rng(1).normal(size=(3, 5)).astype(np_dtype)
    got = dequantize(torch.from_numpy(x), dtype, (3, 5))
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), x.astype(np.float32))


def test_bf16_bytes_equal_gguf_reference():
    x = np.random.default_rng(2).normal(size=(4, 8)).astype(np.float32)
    raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16)  # uint8 [4, 16], as the reader gives it
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.BF16)
    np.testing.assert_array_equal(dequantize(torch.from_numpy(raw), "BF16", (4, 8)).numpy(), expected)


@pytest.mark.parametrize("type_name", ["TQ1_0", "TQ2_0", "MXFP4"])
def test_other_formats_go_through_gguf(type_name):
    """Formats without a de-quantization of ours load through gguf's (rows of several blocks; random
    scale bytes may be NaN, which the comparison takes as equal)."""
    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(3).integers(0, 256, size=(4, 2 * size), dtype=np.uint8)
    expected = gguf.quants.dequantize(raw, qtype)
    got = dequantize(torch.from_numpy(raw), type_name, (4, 2 * block))
    np.testing.assert_array_equal(got.numpy(), expected.astype(np.float32))


def test_unsupported_type_names_itself():
    with pytest.raises(NotImplementedError, match="Q8_K"):
        dequantize(torch.zeros(292, dtype=torch.uint8), "Q8_K", (1, 256))
