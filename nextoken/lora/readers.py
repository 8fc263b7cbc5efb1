"""Reading an adapter: a PEFT folder (`read_adapter`) or a llama.cpp GGUF LoRA file
(`read_gguf_adapter`), checked against the base model and the rank limit."""

from __future__ import annotations

import json
import math
import os
import re

import torch

from nextoken.errors import InvalidRequest
from nextoken.lora.request import LoRARequest

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")


def read_gguf_adapter(req: LoRARequest, max_rank: int, config) -> tuple[dict, float]:
    """A llama.cpp LoRA file (``convert_lora_to_gguf.py``: ``general.type`` adapter,
    ``adapter.lora.alpha``, ``blk.N.attn_q.weight.lora_a`` ``[r, in]`` and ``.lora_b`` ``[out, r]``) as `read_adapter`
    gives a PEFT folder: its B of Q and K un-permuted as the loader does the base weights
    (`loader.gguf_names.GGUF_PERMUTED_QK`). `config`: the base model's `ModelConfig`."""
    import gguf

    from nextoken.layers.rotary import unpermute_qk
    from nextoken.loader.gguf_names import GGUF_PERMUTED_QK, GGUF_PROJECTIONS

    try:
        reader = gguf.GGUFReader(req.lora_path)
        fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    except Exception as exc:  # the gguf package raises several kinds on a damaged file
        raise InvalidRequest(f"adapter {req.lora_name!r}: {req.lora_path} is not a readable GGUF file ({exc})",
                             "lora") from None
    if fields.get("general.type") != "adapter" or fields.get("adapter.type") != "lora":
        raise InvalidRequest(f"adapter {req.lora_name!r}: {req.lora_path} is not a GGUF LoRA adapter", "lora")
    arch = fields.get("general.architecture")
    if arch != config.architecture:
        raise InvalidRequest(f"adapter {req.lora_name!r} is for another base model: a {arch} adapter on a "
                             f"{config.architecture} model", "lora")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        hit = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])", t.name)
        if hit is None or hit.group(2) not in GGUF_PROJECTIONS:
            raise InvalidRequest(f"adapter {req.lora_name!r}: tensor {t.name} is not a LoRA A or B of a supported "
                                 "projection", "lora")
        data = t.data if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else \
            gguf.quants.dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(data.astype("float32").reshape([int(n) for n in reversed(t.shape)]))
        if hit.group(3) == "b" and hit.group(2) in ("attn_q", "attn_k") and arch in GGUF_PERMUTED_QK:
            w = unpermute_qk(w, w.shape[0] // config.head_dim)
        name = f"layers.{hit.group(1)}.{GGUF_PROJECTIONS[hit.group(2)]}"
        parts.setdefault(name, {})[hit.group(3).upper()] = w
    ranks = {ab["A"].shape[0] for ab in parts.values() if "A" in ab}
    if len(ranks) != 1:
        raise InvalidRequest(f"adapter {req.lora_name!r} holds no LoRA weights, or several ranks {sorted(ranks)}",
                             "lora")
    r = ranks.pop()
    alpha = float(fields.get("adapter.lora.alpha") or r)
    return _checked(req, parts, r, max_rank), alpha / r


def _checked(req: LoRARequest, parts: dict, r: int, max_rank: int) -> dict:
    if r > max_rank:
        raise InvalidRequest(f"adapter {req.lora_name!r} has rank {r}, above max_lora_rank {max_rank}", "lora")
    out = {}
    for name, ab in parts.items():
        if set(ab) != {"A", "B"} or ab["A"].shape[0] != r or ab["B"].shape[1] != r:
            raise InvalidRequest(f"adapter {req.lora_name!r}: {name} needs lora_A [r, in] and lora_B [out, r] "
                                 f"with r = {r}", "lora")
        out[name] = (ab["A"], ab["B"])
    if not out:
        raise InvalidRequest(f"adapter {req.lora_name!r} holds no LoRA weights", "lora")
    return out


def read_adapter(req: LoRARequest, max_rank: int, config=None) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]],
                                                                        float]:
    """The adapter's (A, B) per layer name, float32, and its scaling, from a PEFT folder or a
    llama.cpp GGUF LoRA file (`read_gguf_adapter`; `config`: the base model's `ModelConfig`).
    Raises `InvalidRequest`."""
    from safetensors import safe_open

    if os.path.isfile(req.lora_path):
        return read_gguf_adapter(req, max_rank, config)

    cfg_path = os.path.join(req.lora_path, "adapter_config.json")
    weights_path = os.path.join(req.lora_path, "adapter_model.safetensors")
    for p in (cfg_path, weights_path):
        if not os.path.isfile(p):
            raise InvalidRequest(f"adapter {req.lora_name!r}: {p} is missing (a PEFT adapter folder has "
                                 "adapter_config.json and adapter_model.safetensors)", "lora")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        r, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidRequest(f"adapter {req.lora_name!r}: adapter_config.json is not readable ({exc})",
                             "lora") from None
    if r > max_rank:  # before reading the weights
        raise InvalidRequest(f"adapter {req.lora_name!r} has rank {r}, above max_lora_rank {max_rank}", "lora")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    bad = [t for t in targets if t not in SUPPORTED_TARGETS]
    if bad or cfg.get("bias", "none") != "none" or cfg.get("fan_in_fan_out") or cfg.get("rank_pattern") \
            or cfg.get("alpha_pattern") or cfg.get("modules_to_save"):
        what = f"target modules {bad}" if bad else "bias, fan_in_fan_out, rank or alpha patterns, or modules_to_save"
        raise InvalidRequest(f"adapter {req.lora_name!r}: {what} are not supported; supported targets: "
                             f"{', '.join(SUPPORTED_TARGETS)}", "lora")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    parts: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(weights_path, framework="pt") as f:
            for key in f.keys():
                hit = _TENSOR.search(key)
                if hit is None:
                    raise InvalidRequest(f"adapter {req.lora_name!r}: tensor {key} is not a LoRA A or B of a "
                                         "supported layer", "lora")
                name = f"layers.{hit.group(1)}.{hit.group(2)}.{hit.group(3)}"
                parts.setdefault(name, {})[hit.group(4)] = f.get_tensor(key).float()
    except InvalidRequest:
        raise
    except Exception as exc:  # safetensors raises its own errors on damaged files
        raise InvalidRequest(f"adapter {req.lora_name!r}: {weights_path} is not readable ({exc})", "lora") from None
    return _checked(req, parts, r, max_rank), scaling
