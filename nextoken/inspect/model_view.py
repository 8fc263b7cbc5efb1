"""Model widgets: positions (the model's RoPE tables, and the sinusoidal encoding it does not
use), the architecture with parameters and bytes per part, and quantization (stored formats and
the error of re-quantizing a tensor)."""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from nextoken.errors import InvalidRequest, NotFound

MAX_POSITIONS = 512
REQUANT_FORMATS = ("Q8_0", "Q5_0", "Q4_0", "Q4_1", "BF16", "F16")


def _check_range(value, name: str, lo, hi):
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not lo <= value <= hi:
        raise InvalidRequest(f"{name} must be in [{lo}, {hi}], got {value!r}", name)
    return value


def rope_view(model, positions: int = 64, max_distance: int = 4096) -> dict:
    """The model's RoPE (Su et al. 2021): per pair i its rate ``base^(-2i/rope_dim)`` (radians per
    position), the angle ``p * rate`` for positions 0..`positions`-1, the cos table the model
    multiplies by (`DecoderModel.rope`, first half of each head: one column per pair; the
    sliding-window layers' table too when it differs), and the long-range decay of RoFormer
    §3.4.3: ``mean_i cos(d * rate_i)``, the score of a query and key of all ones `d` apart,
    relative to d = 0. A model with learned positions (GPT-2) says so."""
    _check_range(positions, "positions", 2, MAX_POSITIONS)
    cfg = model.config
    if not cfg.rope_dim:
        return {"learned_position_embeddings": True, "max_positions": cfg.context_length}
    pos = torch.arange(positions, device="cpu")
    tables = {k: (c.cpu(), s.cpu()) for k, (c, s) in model.rope(pos.to(model.inv_freq.device)).items()}
    pairs = cfg.rope_dim // 2
    rate = model.inv_freq.float().cpu()
    angle = pos.float()[:, None] * rate[None, :]
    cos = tables[False][0][:, :pairs].float()
    dist = sorted({0, *(int(round(x)) for x in np.geomspace(1, max(2, min(max_distance, cfg.context_length)), 96))})
    decay = torch.cos(torch.tensor(dist, dtype=torch.float64, device="cpu")[:, None] * rate.double()[None, :]).mean(1)
    out = {"rope_dim": cfg.rope_dim, "head_dim": cfg.head_dim, "base": cfg.rope_theta, "pairs": pairs,
           "rate": [float(r) for r in rate], "angle": _rounded(angle, 4), "cos": _rounded(cos, 4),
           "decay": {"distance": dist, "score": [round(float(x), 5) for x in decay]},
           "positions": positions}
    sliding = tables[True][0][:, :pairs].float()
    if not torch.equal(sliding, tables[False][0][:, :pairs].float()):
        out["sliding_cos"] = _rounded(sliding, 4)
    return out


def sinusoidal(base: float = 10000.0, positions: int = 50, dims: int = 64) -> dict:
    """The original transformer's positional encoding (Vaswani et al. 2017, §3.5):
    ``PE[p, 2i] = sin(p / base^(2i/d))``, ``PE[p, 2i+1] = cos(p / base^(2i/d))``, ``[positions, dims]``."""
    _check_range(base, "base", 2, 1e6)
    _check_range(positions, "positions", 1, MAX_POSITIONS)
    _check_range(dims, "dims", 2, 512)
    if dims % 2:
        raise InvalidRequest(f"dims must be even, got {dims}", "dims")
    p = torch.arange(positions, dtype=torch.float64)[:, None]
    inv = base ** (-torch.arange(0, dims, 2, dtype=torch.float64) / dims)
    pe = torch.empty(positions, dims, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(p * inv)
    pe[:, 1::2] = torch.cos(p * inv)
    return {"base": base, "positions": positions, "dims": dims, "values": _rounded(pe, 4)}


def _rounded(t: torch.Tensor, digits: int) -> list:
    return np.round(t.detach().double().cpu().numpy(), digits).tolist()


def _part(name: str) -> str:
    """Which part of the diagram a module belongs to."""
    if "embed" in name or name.startswith("wpe"):
        return "embedding"
    if name.startswith("lm_head"):
        return "lm_head"
    for key, part in (("attn", "attention"), ("mlp", "mlp"), ("norm", "norms"), ("ln", "norms")):
        if key in name:
            return part
    return "other"


def _format(module) -> str:
    if getattr(module, "qweight", None) is not None:
        q = module.qweight
        return f"{q.bits}-bit {'grid indices' if q.lut else 'codes'} (group {q.group})"
    if getattr(module, "int4", None) is not None:
        return "int4 (PyTorch)"
    if getattr(module, "q8", None) is not None:
        return "Q8_0"
    w = getattr(module, "weight", None)
    return str(w.dtype).replace("torch.", "") if w is not None else type(module.method).__name__


def _shares_table(model) -> bool:
    """Whether the LM head reads the embedding table itself (tied, one copy in memory)."""
    head, emb = model.lm_head, model.embed_tokens
    return (head.qweight is not None and head.qweight is emb.qweight) or \
        (head.weight is not None and head.weight is emb.weight)


def architecture(engine, layer_times: list[float] | None = None) -> dict:
    """The loaded model as the diagram draws it: the config, and per part (embedding, attention,
    MLP, norms, LM head) parameters and bytes as held in memory, and the shapes and formats of
    layer 0's weights. `layer_times`: milliseconds per layer in the last inspector trace."""
    cfg, model = engine.config, engine.model
    parts: dict[str, dict] = {}
    seen = set()
    for name, mod in model.named_modules():
        if not hasattr(mod, "nbytes") or id(mod) in seen or name == "":
            continue
        seen.add(id(mod))
        p = parts.setdefault(_part(name), {"parameters": 0, "bytes": 0})
        shape = getattr(mod, "out_features", None), getattr(mod, "in_features", None)
        rows, cols = shape if shape[0] else (getattr(mod, "vocab_size", 0), getattr(mod, "hidden_size", 0))
        p["parameters"] += rows * cols
        p["bytes"] += 0 if name == "lm_head" and _shares_table(model) else mod.nbytes
    counted = {n for n, m in model.named_modules() if hasattr(m, "nbytes")}
    for name, prm in model.named_parameters():  # the rest: norm weights (and GPT-2's biases)
        if name.rpartition(".")[0] not in counted:
            p = parts.setdefault("norms", {"parameters": 0, "bytes": 0})
            p["parameters"] += prm.numel()
            p["bytes"] += prm.nbytes
    layer0 = []
    for name, mod in model.layers[0].named_modules():
        if hasattr(mod, "out_features"):
            layer0.append({"name": name, "shape": [mod.out_features, mod.in_features], "format": _format(mod),
                           "bytes": mod.nbytes, "bias": mod.bias is not None})
    tied = _shares_table(model)
    act = "GELU" if cfg.architecture in ("gpt2",) else ("GELU (tanh), gated" if cfg.architecture.startswith("gemma")
                                                        else "SiLU, gated (SwiGLU)")
    norm = "LayerNorm" if cfg.architecture == "gpt2" else "RMSNorm"
    return {
        "architecture": cfg.architecture, "name": cfg.name, "layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "queries_per_kv": cfg.num_queries_per_kv, "vocab_size": cfg.vocab_size,
        "context_length": cfg.context_length, "max_model_len": engine.max_model_len,
        "rope_theta": cfg.rope_theta, "rope_dim": cfg.rope_dim, "norm": norm, "norm_eps": cfg.norm_eps,
        "activation": act, "tied_embeddings": tied, "sliding_window": cfg.sliding_window,
        "sliding_layers": cfg.sliding_layers, "dtype": str(engine.model.dtype).replace("torch.", ""),
        "parts": parts, "layer0": layer0, "total_bytes": sum(p["bytes"] for p in parts.values()),
        "plan": engine.plan_description(), "layer_times_ms": layer_times,
    }


@functools.lru_cache(maxsize=2)
def _gguf(path: str):
    from nextoken.loader.gguf import GGUFFile

    return GGUFFile(path)


def stored_tensors(path: str) -> dict:
    """The tensors of a GGUF file by format: count, parameters and bytes per GGML type, against
    the same parameters in bf16 and fp32; and every tensor's name, type, shape and bytes."""
    if not str(path).endswith(".gguf"):
        raise NotFound("the stored-format view reads GGUF files; this model is a Hugging Face folder", "model")
    f = _gguf(path)
    tensors = [{"name": n, "type": f.tensor_type(n), "shape": list(f.tensor_shape(n)),
                "bytes": f.tensor_nbytes(n)} for n in f.tensor_names]
    by: dict[str, dict] = {}
    for t in tensors:
        b = by.setdefault(t["type"], {"tensors": 0, "parameters": 0, "bytes": 0})
        b["tensors"] += 1
        b["parameters"] += math.prod(t["shape"])
        b["bytes"] += t["bytes"]
    params = sum(b["parameters"] for b in by.values())
    return {"formats": by, "tensors": tensors, "parameters": params,
            "bytes": sum(b["bytes"] for b in by.values()), "bf16_bytes": 2 * params, "fp32_bytes": 4 * params}


def requant_error(path: str, name: str, max_rows: int = 1024) -> dict:
    """Tensor `name` as stored, de-quantized, then re-quantized to each of `REQUANT_FORMATS` with
    the `gguf` package's reference quantizers: bits per weight, RMS error and max abs error
    relative to the stored values (first `max_rows` rows)."""
    import gguf
    from nextoken.layers.quantization.ggml import dequantize

    f = _gguf(path)
    if not f.has_tensor(name):
        raise NotFound(f"no tensor {name!r} in the model (see the tensor list)", "tensor")
    shape = f.tensor_shape(name)
    if len(shape) != 2:
        raise NotFound(f"tensor {name!r} is not a matrix (shape {list(shape)})", "tensor")
    rows = min(shape[0], max_rows)
    x = dequantize(f.raw(name, 0, rows), f.tensor_type(name), (rows, shape[1])).float().numpy()
    rms = float(np.sqrt((x.astype(np.float64) ** 2).mean()))
    out = []
    for fmt in REQUANT_FORMATS:
        qt = gguf.GGMLQuantizationType[fmt]
        block, size = gguf.GGML_QUANT_SIZES[qt]
        if shape[1] % block:
            continue
        back = gguf.quants.dequantize(gguf.quants.quantize(x, qt), qt).astype(np.float64)
        err = back - x
        out.append({"format": fmt, "bits_per_weight": round(8 * size / block, 3),
                    "rms_error": float(np.sqrt((err ** 2).mean())), "max_abs_error": float(np.abs(err).max()),
                    "relative_rms": float(np.sqrt((err ** 2).mean())) / rms if rms else 0.0})
    return {"tensor": name, "stored_type": f.tensor_type(name), "shape": list(shape), "rows_used": rows,
            "rms": rms, "requantized": out}
