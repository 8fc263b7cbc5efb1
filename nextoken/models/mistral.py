"""The Mistral architecture (Jiang et al. 2023): Llama's layout, where every layer may attend to
a sliding window of the last ``sliding_window`` keys (`layers.sliding_attention`; None in later
Mistral releases: plain causal attention). Mistral GGUF files say ``llama``; this class serves
Hugging Face folders (``MistralForCausalLM``)."""

from nextoken.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
