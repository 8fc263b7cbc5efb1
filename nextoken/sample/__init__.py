"""Turning logits into tokens: logits processors and the sampler."""
