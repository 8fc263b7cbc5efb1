"""LoRA adapters per request: request, readers, each linear's slots, the manager.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
Models"): a request names an adapter, and each targeted linear adds ``scaling * (x A^T) B^T`` to
its output for that request's tokens, the base weights staying on our quantized kernels.

An adapter is a PEFT folder, or a llama.cpp GGUF LoRA file (`read_gguf_adapter`). A PEFT folder:
``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``) and
``adapter_model.safetensors`` (``...layers.N.self_attn.q_proj.lora_A.weight``
``[r, in]`` and ``...lora_B.weight`` ``[out, r]``). ``scaling = lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with rsLoRA (Kalajdzievski 2023). Targets: q, k, v, o, gate, up and down
projections of Llama-style layers.

In a batch, every adapter's A is stacked into one matrix and every B into another, and a mask
keeps each token to its own adapter's columns: two small matmuls per targeted layer whatever the
number of adapters (`LoRASlots.add`), so requests for different adapters and for the base model
share one forward pass. The one-call C decode step (`layers.native_decode`) adds each row's
adapter too (`kernels/decode.c`: the same bf16 roundings as `LoRASlots.add`; AMX tiles for rows
sharing an adapter where the CPU has them).
"""

from nextoken.lora.request import LoRARequest, parse_lora_modules

__all__ = ["LoRARequest", "parse_lora_modules"]
# (the package: request.py the request value and the --lora-modules parser; readers.py PEFT
# folders and GGUF LoRA files; slots.py one linear layer's adapters; manager.py the adapters of
# one model)
