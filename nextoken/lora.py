"""LoRA adapters per request (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
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
share one forward pass. A decode step with any adapter runs the PyTorch layers (the
one-call C decode step knows nothing of adapters).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from nextoken.errors import InvalidRequest

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: which adapter a request uses. `lora_int_id` >= 1 names it in the engine."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass
class LoRABatch:
    """The current pass's adapters, set by the runner before each forward pass: `ids`, the
    adapters present (in column order), `ranks` of every loaded adapter, and `mask` ``[T, R]``
    (R: the sum of their ranks), 1 where token t's adapter owns column c, else 0 (base-model
    tokens have a zero row). Empty `ids` when no request of the pass uses an adapter."""

    ids: tuple[int, ...] = ()
    ranks: dict[int, int] = field(default_factory=dict)
    mask: torch.Tensor | None = None


class LoRASlots:
    """One linear layer's adapters: adapter id -> (A ``[r, in]``, scaling * B ``[out, r]``),
    float32, and the pass's `LoRABatch`. For each set of adapters in a pass, their A are stacked
    ``[R, in]`` and B ``[out, R]`` once (zeros for an adapter that does not target this layer)."""

    def __init__(self, batch: LoRABatch):
        self.batch = batch
        self.weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._stacked: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def set(self, adapter: int, a: torch.Tensor, b: torch.Tensor | None) -> None:
        """Hold adapter `adapter`'s A and scaled B (None: drop it)."""
        if b is None:
            self.weights.pop(adapter, None)
        else:
            self.weights[adapter] = (a, b)
        self._stacked.clear()

    def _stack(self, ids: tuple[int, ...], ranks: dict[int, int], x_in: int, y_out: int):
        got = self._stacked.get(ids)
        if got is None:
            parts = [self.weights.get(i) or (torch.zeros(ranks[i], x_in), torch.zeros(y_out, ranks[i])) for i in ids]
            got = self._stacked[ids] = (torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts], dim=1))
        return got

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus, for each token, its adapter's ``(x A^T) (s B)^T`` (x ``[T, in]``, y
        ``[T, out]``): two matmuls for every adapter of the pass together, the mask keeping each
        token to its own adapter's columns."""
        batch = self.batch
        if not any(i in self.weights for i in batch.ids):
            return y
        a, b = self._stack(batch.ids, batch.ranks, x.shape[1], y.shape[1])
        delta = ((x.float() @ a.T) * batch.mask) @ b.T
        return y + delta.to(y.dtype)


def parse_lora_modules(items: list[str]) -> list[LoRARequest]:
    """``--lora-modules NAME=PATH ...`` as `LoRARequest`s with ids 1, 2, ...; `InvalidRequest`
    for an item without ``=`` or a name given twice."""
    out: dict[str, LoRARequest] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise InvalidRequest(f"--lora-modules takes NAME=PATH items, got {item!r}", "lora_modules")
        if name in out:
            raise InvalidRequest(f"--lora-modules names {name!r} twice", "lora_modules")
        out[name] = LoRARequest(name, len(out) + 1, path)
    return list(out.values())


def _linears(model) -> dict[str, torch.nn.Module]:
    """``"layers.N.self_attn.q_proj"`` (and the MLP's) -> our `Linear` module."""
    out = {}
    for name, m in model.named_modules():
        hit = re.search(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)$", name)
        if hit and hit.group(3) in SUPPORTED_TARGETS:
            out[hit.group(0)] = m
    return out


class LoRAManager:
    """The adapters loaded into one model (at most `max_loras`, of rank <= `max_lora_rank`):
    `add` loads a `LoRARequest` once and returns its id; `remove` unloads it."""

    def __init__(self, model, max_loras: int = 8, max_lora_rank: int = 64):
        self.model, self.max_loras, self.max_lora_rank = model, max_loras, max_lora_rank
        self.batch = LoRABatch()
        self.loaded: dict[int, LoRARequest] = {}
        self.linears = _linears(model)

    def add(self, req: LoRARequest) -> int:
        """Load `req`'s adapter (once per id); its id. Raises `InvalidRequest` (field ``lora``)
        for a missing or unreadable folder, a rank above the limit, a target we do not
        support, tensors of another base model, or more adapters than `max_loras`."""
        if not isinstance(req.lora_int_id, int) or req.lora_int_id < 1:
            raise InvalidRequest(f"lora_int_id must be an integer >= 1, got {req.lora_int_id!r}", "lora")
        if req.lora_int_id in self.loaded:
            return req.lora_int_id
        weights, scaling = read_adapter(req, self.max_lora_rank, self.model.config)
        for name, (a, b) in weights.items():
            lin = self.linears.get(name)
            if lin is None:
                raise InvalidRequest(f"adapter {req.lora_name!r}: the model has no layer {name}", "lora")
            if a.shape[1] != lin.in_features or b.shape[0] != lin.out_features:
                raise InvalidRequest(f"adapter {req.lora_name!r} is for another base model: {name} takes "
                                     f"{lin.in_features} -> {lin.out_features}, the adapter "
                                     f"{a.shape[1]} -> {b.shape[0]}", "lora")
        if len(self.loaded) >= self.max_loras:
            raise InvalidRequest(f"{len(self.loaded)} adapters are loaded, the limit (max_loras); unload one first",
                                 "lora")
        for name, (a, b) in weights.items():
            lin = self.linears[name]
            if lin.lora is None:
                lin.lora = LoRASlots(self.batch)
            lin.lora.set(req.lora_int_id, a, b * scaling)
        self.loaded[req.lora_int_id] = req
        self.batch.ranks[req.lora_int_id] = next(iter(weights.values()))[0].shape[0]
        return req.lora_int_id

    def remove(self, lora_id: int) -> bool:
        """Unload adapter `lora_id`; whether it was loaded."""
        if self.loaded.pop(lora_id, None) is None:
            return False
        for lin in self.linears.values():
            if lin.lora is not None:
                lin.lora.set(lora_id, None, None)
        self.batch.ranks.pop(lora_id, None)
        return True

    def set_batch(self, adapter_of_row: list[int]) -> None:
        """This pass's adapter per token row (0: the base model): the batch's ids and mask."""
        ids = tuple(sorted(set(adapter_of_row) - {0}))
        self.batch.ids = ids
        if not ids:
            self.batch.mask = None
            return
        starts, at = {}, 0
        for i in ids:
            starts[i], at = at, at + self.batch.ranks[i]
        rows = torch.tensor(adapter_of_row)
        mask = torch.zeros(len(adapter_of_row), at)
        for i in ids:
            mask[rows == i, starts[i] : starts[i] + self.batch.ranks[i]] = 1.0
        self.batch.mask = mask


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
