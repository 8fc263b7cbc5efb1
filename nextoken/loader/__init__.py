"""Model file loaders: GGUF (and, later, safetensors folders)."""
