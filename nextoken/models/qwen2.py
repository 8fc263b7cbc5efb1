"""The Qwen2 architecture (Qwen2.5-Coder): Llama's layout with biases on q, k and v.

Differences from `llama.LlamaForCausalLM`: ``attention_bias`` (read from the file: the GGUF has
``attn_{q,k,v}.bias``) and RoPE in the "rotate half" (NeoX) pairing in GGUF too, so llama.cpp's
converter does not permute Q and K and we do not un-permute them.
"""

from nextoken.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    GGUF_PERMUTED_QK = False
