"""The sampling defaults a model's creator recommends: the fields of a Hugging Face folder's
``generation_config.json`` that requests leaving them unset take (vLLM's ``--generation-config
auto``, its default since v0.7).

Which fields: temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as
``max_tokens``); the others (do_sample, num_beams, ...) change nothing here, as in vLLM. A value
equal to ``transformers``' own `GenerationConfig` default is no advice and is left out (vLLM
reads the file's ``to_diff_dict``): a file saying ``top_k: 50`` leaves top_k off. How they apply:
a request that leaves a sampling field unset gets the model's value (the server's APIs, and
`LLM.generate` without `SamplingParams`), and one that gives no output bound gets
``max_tokens`` (vLLM also bounds a request's own max_tokens by it; here a request's own bound
holds). A GGUF file carries none.

    generation_config="auto"     the model folder's file (none for a GGUF file)
    generation_config="vllm"     none: every API's own defaults
    generation_config=FOLDER     that folder's generation_config.json
    override_generation_config   {field: value} over the above (vLLM's names: max_new_tokens)
"""

from __future__ import annotations

import json
import os

from nextoken.errors import InvalidRequest

# transformers' GenerationConfig defaults of the fields read (None: no default)
HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0,
               "max_new_tokens": None}
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # defaulted when unset


def read_file(folder: str) -> dict:
    """The fields of `folder`'s generation_config.json that differ from transformers' defaults,
    under `SamplingParams`' names; {} without the file. Raises `InvalidRequest` for a file that
    is not a JSON object."""
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"{path} cannot be read as JSON: {exc}", "generation_config") from None
    if not isinstance(config, dict):
        raise InvalidRequest(f"{path} is not a JSON object", "generation_config")
    return {_name(k): v for k, v in config.items() if k in HF_DEFAULTS and v is not None and v != HF_DEFAULTS[k]}


def resolve(model_path: str, generation_config: str = "auto", overrides: dict | None = None) -> dict:
    """The sampling defaults of the model at `model_path` (a folder or a GGUF file) under the
    engine's `generation_config` and `override_generation_config` (module docstring): a dict
    of `SamplingParams` field -> value, each checked. Raises `InvalidRequest` naming the option
    for a folder without the file asked for, an unknown field or a value out of range."""
    from nextoken.sampling_params import SamplingParams

    if generation_config == "vllm":
        found = {}
    elif generation_config == "auto":
        found = read_file(model_path) if os.path.isdir(model_path) else {}
    elif os.path.isfile(os.path.join(generation_config, "generation_config.json")):
        found = read_file(generation_config)
    else:
        raise InvalidRequest(f"generation_config {generation_config!r} is not auto, vllm or a folder holding a "
                             "generation_config.json", "generation_config")
    for key, value in (overrides or {}).items():
        if key not in HF_DEFAULTS:
            raise InvalidRequest(f"override_generation_config: {key!r} is not one of {', '.join(HF_DEFAULTS)}",
                                 "override_generation_config")
        found[_name(key)] = value
    try:
        SamplingParams(**found).validate()
    except (InvalidRequest, TypeError) as exc:
        raise InvalidRequest(f"the model's sampling defaults {found}: {exc}", "generation_config") from None
    return found


def unset(given) -> frozenset[str]:
    """The `SAMPLING_FIELDS` a request left unset: those not among `given` (the names of the
    fields it set, `SamplingParams`' spelling; a pydantic body's ``model_fields_set``)."""
    return frozenset(SAMPLING_FIELDS).difference(given)


def _name(key: str) -> str:
    return "max_tokens" if key == "max_new_tokens" else key
