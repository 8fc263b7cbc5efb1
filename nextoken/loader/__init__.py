"""Reading models: GGUF files and Hugging Face folders (safetensors), the prepared-weights cache."""
