"""Green-list watermark (Kirchenbauer et al. 2023, "A Watermark for Large Language Models",
Algorithm 2 with the "simple_1" seeding), as Hugging Face's text-generation-inference applies it.

Before each token is drawn, the previous token ``t`` seeds a CPU ``torch.Generator`` with
``hash_key * t`` (hash_key = 15485863); ``torch.randperm(vocab)`` under that generator, cut to
its first ``int(vocab * gamma)`` ids, is the green list, and every green logit gets ``+delta``.
Text written that way holds more green tokens than chance, which `detect` measures:

    z = (|s|_G - gamma * T) / sqrt(T * gamma * (1 - gamma))

over the T tokens that have a predecessor, |s|_G of them green (the paper's one-proportion
z-test, its equation 2). Without the watermark z is about standard normal; z > 4 is the paper's
threshold for "watermarked".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (`WatermarkConfig` travels to server processes that have no PyTorch loaded)
    import torch

HASH_KEY = 15485863  # the paper's and TGI's key: a large prime


@dataclass(frozen=True)
class WatermarkConfig:
    """gamma: the share of the vocabulary that is green, in (0, 1); delta: what a green logit
    gains (> 0). Server-wide: `--watermark-gamma`, `--watermark-delta` (TGI's defaults)."""

    gamma: float = 0.5
    delta: float = 2.0

    def __post_init__(self):
        if not 0.0 < self.gamma < 1.0:
            raise ValueError(f"watermark gamma must be in (0, 1), got {self.gamma}")
        if not self.delta > 0.0 or not math.isfinite(self.delta):
            raise ValueError(f"watermark delta must be a positive number, got {self.delta}")


def green_mask(prev_token: int, vocab_size: int, gamma: float) -> torch.Tensor:
    """bool ``[vocab_size]``: the green list that follows `prev_token`."""
    import torch

    g = torch.Generator(device="cpu")
    g.manual_seed(HASH_KEY * int(prev_token))
    perm = torch.randperm(vocab_size, generator=g, device="cpu")
    mask = torch.zeros(vocab_size, dtype=torch.bool, device="cpu")
    mask[perm[: int(vocab_size * gamma)]] = True
    return mask


def apply_watermark(logits: torch.Tensor, prev_token: int, config: WatermarkConfig) -> torch.Tensor:
    """Add delta to the green logits of one row ``[vocab]`` in place; returns it."""
    logits[green_mask(prev_token, logits.shape[0], config.gamma).to(logits.device)] += config.delta
    return logits


@dataclass
class Detection:
    num_tokens_scored: int
    num_green_tokens: int
    green_fraction: float
    z_score: float
    watermarked: bool


def detect(token_ids: list[int], vocab_size: int, gamma: float, z_threshold: float = 4.0) -> Detection:
    """Score token ids for the watermark (formula in the module docstring). Each token but the
    first is scored against the green list of the token before it."""
    scored = len(token_ids) - 1
    if scored < 1:
        return Detection(0, 0, 0.0, 0.0, False)
    green = sum(bool(green_mask(prev, vocab_size, gamma)[tok]) for prev, tok in zip(token_ids, token_ids[1:]))
    z = (green - gamma * scored) / math.sqrt(scored * gamma * (1 - gamma))
    return Detection(scored, green, green / scored, z, z > z_threshold)
