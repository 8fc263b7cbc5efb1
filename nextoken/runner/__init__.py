"""Running the model: KV cache and the model runner (prefill and decode)."""
