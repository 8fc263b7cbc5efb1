"""The Qwen3 architecture: Llama's layout with an RMSNorm over each query and key head before
RoPE ("QK-norm"), no q/k/v biases, and an explicit ``head_dim``. Numbers match `transformers`'
``Qwen3ForCausalLM`` in float32 (the tests compare them). GGUF files (``qwen3``) store the
norms as ``blk.N.attn_q_norm`` / ``attn_k_norm`` and Q/K unpermuted (NeoX RoPE)."""

from nextoken.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    QK_NORM = True
