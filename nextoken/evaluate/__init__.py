"""Scoring text: perplexity as ``llama-perplexity`` computes it, KL divergence from float32."""
