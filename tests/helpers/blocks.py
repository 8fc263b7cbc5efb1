"""Random GGUF blocks with finite float16 scales, for the block-format tests."""

from __future__ import annotations

import numpy as np

import gguf

F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0], "Q3_K": [108],
              "Q2_K": [80, 82], "IQ3_S": [0], "IQ3_XXS": [0], "IQ2_XXS": [0], "IQ2_XS": [0],
              "IQ2_S": [0], "IQ1_S": [0], "IQ1_M": []}  # where each format keeps its float16 scales (IQ1_M: below)


def random_blocks(type_name: str, n_blocks: int, seed: int) -> np.ndarray:
    _, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in F16_FIELDS[type_name]:
        scales = rng.uniform(-2, 2, size=n_blocks).astype(np.float16)
        raw[:, off : off + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    if type_name == "IQ1_M":  # d's 16 bits in the top nibbles of the four uint16 scales at byte 48
        d = rng.uniform(-2, 2, size=n_blocks).astype(np.float16).view(np.uint16).astype(np.uint16)
        sc = raw[:, 48:56].copy().view(np.uint16) & 0x0FFF
        sc |= (d[:, None] >> np.array([0, 4, 8, 12], dtype=np.uint16)[None] << 12).astype(np.uint16)
        raw[:, 48:56] = sc.view(np.uint8)
    return raw
