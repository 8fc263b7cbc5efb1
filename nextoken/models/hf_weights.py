"""Copying a Hugging Face folder's tensors into a model's parameters, by name."""

from __future__ import annotations

from typing import Callable

import torch

from nextoken.errors import ModelLoadError


def load_hf_weights(model: torch.nn.Module, d, weight_map: dict[str, str],
                    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                    optional: frozenset[str] = frozenset()) -> None:
    """For every ``hf_name -> our_name`` of `weight_map`, read tensor hf_name of `HFModelDir` d,
    apply ``transform(hf_name, tensor)`` (float32 in, our layout out) and copy it into parameter
    our_name in the model's dtype. Names in `optional` may be absent (a tied head). Raises
    `ModelLoadError` naming a tensor that is missing or whose shape differs from ours."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for hf_name, ours in weight_map.items():
        if not d.has_tensor(hf_name):
            if hf_name in optional:
                continue
            raise ModelLoadError(f"{d.path}: tensor {hf_name} is missing from the safetensors weights")
        w = d.tensor(hf_name, torch.float32)
        if transform is not None:
            w = transform(hf_name, w)
        target = params[ours]
        if tuple(w.shape) != tuple(target.shape):
            raise ModelLoadError(f"{d.path}: tensor {hf_name} has shape {tuple(w.shape)}, expected "
                                 f"{tuple(target.shape)}")
        target.data.copy_(w)
