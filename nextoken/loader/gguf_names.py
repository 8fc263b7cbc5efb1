"""llama.cpp's GGUF tensor names (``gguf-py/gguf/constants.py``) and ours, without PyTorch:
the loader (`loader.weights`) and the first token of ``nextoken run`` (`runner.quick_start`)
read the same names."""

from __future__ import annotations

GGUF_LAYER_NAMES = {
    "llama": {"attn_norm.weight": "input_layernorm", "ffn_norm.weight": "post_attention_layernorm"},
    "gemma3": {"attn_norm.weight": "input_layernorm", "post_attention_norm.weight": "post_attention_layernorm",
               "ffn_norm.weight": "pre_feedforward_layernorm", "post_ffw_norm.weight": "post_feedforward_layernorm"},
}
# a layer's projections, in the order of ``kernels/decode.c``'s layer_t (q, k, v, o, gate, up, down)
GGUF_PROJECTIONS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                    "ffn_down": "mlp.down_proj"}
# llama.cpp's converter permutes Q and K of these architectures for its interleaved RoPE
# (``convert_hf_to_gguf.py``, ``LlamaModel.permute``); Qwen and Gemma files keep the NeoX order
GGUF_PERMUTED_QK = {"llama"}
GGUF_EMBEDDING, GGUF_OUTPUT, GGUF_OUTPUT_NORM = "token_embd.weight", "output.weight", "output_norm.weight"


def layer_projection(layer: int, gguf: str, part: str = "weight") -> str:
    """The GGUF name of `layer`'s projection `gguf` (a key of `GGUF_PROJECTIONS`)."""
    return f"blk.{layer}.{gguf}.{part}"
