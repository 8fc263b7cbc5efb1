"""The Qwen2 architecture (Qwen2.5-Coder): Llama's layout with biases on q, k and v.

Differences from `llama.LlamaForCausalLM`: ``attention_bias`` (read from the file: the GGUF has
``attn_{q,k,v}.bias``), and in GGUF files Q and K are stored in the "rotate half" (NeoX) order,
which the loader leaves as it is (`loader.gguf_names.GGUF_PERMUTED_QK`).
"""

from nextoken.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
