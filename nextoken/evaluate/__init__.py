"""Scoring text: perplexity as llama.cpp's ``llama-perplexity`` computes it, and the KL
divergence of the fast path from the float32 reference (`perplexity.py`)."""
