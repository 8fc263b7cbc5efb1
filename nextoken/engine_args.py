"""`EngineArgs`: every engine option, defined once (vLLM's name and role).

Each field has its default, its help text and its command-line flag here, and `validate` checks
it. `LLM(...)`, ``nextoken run | chat | explain``, ``nextoken serve`` and ``nextoken bench`` all
build their engine from one `EngineArgs`:

    parser -> EngineArgs.add_cli_args(parser)       # the same flags on every command
    args   -> EngineArgs.from_cli_args(namespace)   # or EngineArgs(model=..., block_size=...)
           -> LLMEngine.from_engine_args(args)      # the one place an engine is built

Commands differ only in defaults (the single-user commands run one sequence at a time:
``max_num_seqs=1``). This module imports no torch, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from nextoken.catalog import DEFAULT_MODEL
from nextoken.config import KV_CACHE_DTYPES
from nextoken.errors import InvalidRequest

DTYPE_CHOICES = ("auto", "bfloat16", "float32", "bf16", "fp32")
SPECULATIVE_METHODS = ("draft", "ngram")


def _opt(default: Any, help: str, flag: str | None = None, group: str = "model", cli: str = "value",
         **argparse_kwargs) -> Any:
    """A field with its command-line form: `flag` (default ``--field-name``), `cli` one of
    ``value`` (takes a value), ``true`` (a switch that sets True), ``bool`` (``--x/--no-x``),
    ``size`` (bytes given as ``512MiB``), or ``none`` (Python only)."""
    meta = {"help": help, "flag": flag, "group": group, "cli": cli, "argparse": argparse_kwargs}
    return field(default=default, metadata=meta)


@dataclass
class EngineArgs:
    """Everything that decides how an engine is built and runs. Construct it directly (Python),
    or with `from_cli_args`; either way `validate` runs, and a bad value raises `InvalidRequest`
    naming the field."""

    model: str = _opt(DEFAULT_MODEL, "catalog name (see `nextoken models`), path to a .gguf file or a Hugging Face "
                      "model folder, or a hub id org/name from the huggingface_hub cache", flag="--model")
    dtype: str = _opt("auto", "weights and activations dtype: auto (bfloat16 for GGUF; a Hugging Face folder's "
                      "config dtype), bfloat16, or float32 (the exact reference)", choices=DTYPE_CHOICES)
    num_threads: int | None = _opt(None, "compute threads (default: one per core this process may use)",
                                   flag="--threads", type=int)
    enforce_eager: bool = _opt(False, "PyTorch only, none of nextoken's C kernels (the reference path); fixed at "
                               "load in the execution plan", cli="true")
    reference_attention: bool = _opt(False, "plain float32 attention (the reference) instead of the fast paths",
                                     cli="true")
    dense_weights: bool = _opt(False, "with --enforce-eager (PyTorch's int4 kernel), also keep bf16 copies of "
                               "int4-packed weights for calls of many rows (about 4x the weight memory)", cli="bool")
    tensor_parallel_size: int = _opt(1, "processes the model is split across (Megatron-style: heads, feed-forward "
                                     "columns and vocabulary; one all-reduce after attention and after the MLP). "
                                     "Alone, rank 0 starts the others on this machine, each on its own cores; across "
                                     "hosts, launch with torchrun --nproc-per-node N --nnodes ...", type=int)
    auto_pull: bool = _opt(True, "download a catalog model on first use", cli="none")
    prepared_cache: bool = _opt(True, "keep GGUF weights repacked for our kernels in <cache>/prepared (keyed by the "
                                "file's SHA-256) and memory-map them on later starts", cli="bool")
    # KV cache
    max_model_len: int | None = _opt(None, "most tokens per sequence, prompt + output (default: the model's "
                                     "context length); also sizes the default KV cache", group="KV cache", type=int)
    kv_cache_memory: int | None = _opt(None, "bytes for the KV cache, e.g. 512MiB or 2GB (default: max_num_seqs "
                                       "full contexts, at most a quarter of free memory and 1 GiB)",
                                       group="KV cache", cli="size")
    num_kv_blocks: int = _opt(0, "KV cache blocks, overriding --kv-cache-memory (0: from the memory budget)",
                              group="KV cache", type=int)
    block_size: int = _opt(16, "tokens per KV cache block", group="KV cache", type=int)
    kv_cache_dtype: str = _opt("auto", "KV cache storage: auto (the model's dtype) or int8 (each token's key and "
                               "value rows per head as int8 with a float32 scale: about half the bytes of bf16, "
                               "so twice the tokens fit and long-context decode reads half as much)",
                               group="KV cache", choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = _opt(True, "reuse the KV of shared prompt prefixes", flag="--prefix-caching",
                                       group="KV cache", cli="bool")
    # scheduler
    max_num_seqs: int = _opt(64, "sequences running at once", group="scheduler", type=int)
    max_num_batched_tokens: int = _opt(2048, "new tokens per step (prefill chunks + decodes)", group="scheduler",
                                       type=int)
    enable_chunked_prefill: bool = _opt(True, "split long prompts over several steps", flag="--chunked-prefill",
                                        group="scheduler", cli="bool")
    # speculative decoding
    speculative_model: str | None = _opt(None, "draft model (catalog name, .gguf or folder) with the target's "
                                         "vocabulary", group="speculative decoding")
    speculative_method: str | None = _opt(None, "draft (needs --speculative-model) or ngram (prompt lookup, no "
                                          "second model)", group="speculative decoding", choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = _opt(4, "tokens proposed per step", group="speculative decoding", type=int)
    # output
    watermark_gamma: float = _opt(0.5, "share of the vocabulary on each green list of the watermark (requests "
                                  "with watermark on)", group="output", type=float)
    watermark_delta: float = _opt(2.0, "what the watermark adds to a green token's logit", group="output",
                                  type=float)
    chat_template: str | None = _opt(None, "a Jinja chat template file to use instead of the model's (e.g. one "
                                     "with tool support)", group="output", metavar="FILE")

    def __post_init__(self):
        if isinstance(self.kv_cache_memory, str):  # Python callers may write sizes as on the command line
            self.kv_cache_memory = parse_size(self.kv_cache_memory)
        self.validate()

    # -- checks ---------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise `InvalidRequest` naming the first field whose value is out of range."""
        if not isinstance(self.model, str) or not self.model:
            raise InvalidRequest("model must be a non-empty name or path", "model")
        if self.dtype not in DTYPE_CHOICES:
            raise InvalidRequest(f"dtype {self.dtype!r} is not supported; choose from {', '.join(DTYPE_CHOICES)}",
                                 "dtype")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequest(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; choose from "
                                 f"{', '.join(KV_CACHE_DTYPES)}", "kv_cache_dtype")
        for name, low in (("num_threads", 1), ("tensor_parallel_size", 1), ("max_model_len", 1), ("kv_cache_memory", 1), ("num_kv_blocks", 0),
                          ("block_size", 1), ("max_num_seqs", 1), ("max_num_batched_tokens", 1),
                          ("num_speculative_tokens", 1)):
            value = getattr(self, name)
            if value is None and name in ("num_threads", "max_model_len", "kv_cache_memory"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidRequest(f"{name} must be an integer >= {low}, got {value!r}", name)
        for f in dataclasses.fields(self):
            if f.metadata["cli"] in ("true", "bool") or f.name == "auto_pull":
                if not isinstance(getattr(self, f.name), bool):
                    raise InvalidRequest(f"{f.name} must be True or False, got {getattr(self, f.name)!r}", f.name)
        for name, ok, rule in (("watermark_gamma", lambda v: 0 < v < 1, "in (0, 1)"),
                               ("watermark_delta", lambda v: 0 < v <= 100, "in (0, 100]")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise InvalidRequest(f"{name} must be a number {rule}, got {value!r}", name)
        if self.speculative_method is not None and self.speculative_method not in SPECULATIVE_METHODS:
            raise InvalidRequest(f"unknown speculative method {self.speculative_method!r}: use 'draft' or 'ngram'",
                                 "speculative_method")
        if self.speculative_method == "draft" and self.speculative_model is None:
            raise InvalidRequest("speculative method 'draft' needs speculative_model", "speculative_model")
        if self.speculative_method == "ngram" and self.speculative_model is not None:
            raise InvalidRequest("speculative method 'ngram' takes no speculative_model", "speculative_model")

    @property
    def speculative(self) -> str | None:
        """The speculative method in force (a draft model alone means ``"draft"``), or None."""
        if self.speculative_method is None and self.speculative_model is None:
            return None
        return self.speculative_method or "draft"

    def replace(self, **changes) -> EngineArgs:
        return dataclasses.replace(self, **changes)

    # -- command line ---------------------------------------------------------------------
    @classmethod
    def cli_fields(cls) -> list[dataclasses.Field]:
        """The fields that have a command-line flag."""
        return [f for f in dataclasses.fields(cls) if f.metadata["cli"] != "none"]

    @staticmethod
    def flag(f: dataclasses.Field) -> str:
        return f.metadata["flag"] or "--" + f.name.replace("_", "-")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, exclude: tuple[str, ...] = (), **defaults) -> None:
        """Add every engine flag to `parser` (grouped as in ``--help``), with `defaults`
        overriding the field defaults, and none of the fields named in `exclude`."""
        groups: dict[str, Any] = {}
        for f in cls.cli_fields():
            if f.name in exclude:
                continue
            group = parser if f.metadata["group"] == "model" else groups.setdefault(
                f.metadata["group"], parser.add_argument_group(f.metadata["group"]))
            default = defaults.get(f.name, f.default)
            kind, flag = f.metadata["cli"], cls.flag(f)
            shown = f.metadata["help"] + ("" if default in (None, False) or kind == "true" else f" (default {default})")
            names = [flag, "-m"] if f.name == "model" else [flag]
            if kind == "true":
                group.add_argument(*names, dest=f.name, action="store_true", default=default, help=shown)
            elif kind == "bool":
                group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                   help=shown)
            elif kind == "size":
                group.add_argument(*names, dest=f.name, type=_cli_size, default=default, metavar="SIZE", help=shown)
            else:
                extra = dict(f.metadata["argparse"])
                if extra.get("type") is int:
                    extra.setdefault("metavar", "N")
                elif "choices" not in extra:
                    extra.setdefault("metavar", f.name.rsplit("_", 1)[-1].upper())
                group.add_argument(*names, dest=f.name, default=default, help=shown, **extra)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace, **overrides) -> EngineArgs:
        """The `EngineArgs` of parsed command-line arguments (fields without a flag keep their
        defaults unless given in `overrides`)."""
        values = {f.name: getattr(ns, f.name) for f in cls.cli_fields() if hasattr(ns, f.name)}
        return cls(**{**values, **overrides})

    def to_cli_args(self, exclude: tuple[str, ...] = ()) -> list[str]:
        """The flags that rebuild these arguments (for a child process): ``from_cli_args`` of
        their parse equals ``self`` on every field with a flag."""
        out: list[str] = []
        for f in self.cli_fields():
            if f.name in exclude:
                continue
            value, flag, kind = getattr(self, f.name), self.flag(f), f.metadata["cli"]
            if kind == "true":
                out += [flag] if value else []
            elif kind == "bool":
                out.append(flag if value else "--no-" + flag[2:])
            elif value is not None:
                out += [flag, str(value)]
        return out


def _cli_size(text: str) -> int:
    try:
        return parse_size(text)
    except InvalidRequest as e:
        raise argparse.ArgumentTypeError(str(e)) from None


SIZE_UNITS = {"": 1, "b": 1,
              "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
              "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30, "ti": 2**40,
              "tib": 2**40}


def parse_size(text: str | int) -> int:
    """A size in bytes: a number, or a number with a unit. SI units are powers of 1000 (``k``,
    ``M``, ``G``, ``T``, with or without ``B``: ``2GB`` = 2 * 10^9), IEC units powers of 1024
    (``Ki``, ``Mi``, ``Gi``, ``Ti``, with or without ``B``: ``512MiB`` = 512 * 2^20); case does
    not matter. Raises `InvalidRequest` (field ``kv_cache_memory``) for anything else or a size
    that is not positive."""
    t = str(text).strip()
    num = t.rstrip("bBiIkKmMgGtT")
    unit = t[len(num):].lower()
    try:
        value = float(num) * SIZE_UNITS[unit]
    except (ValueError, KeyError):
        raise InvalidRequest(f"cannot read size {text!r}: use a number of bytes or a unit, e.g. 512MiB, 2GiB "
                             "(powers of 1024) or 2GB (powers of 1000)", "kv_cache_memory") from None
    if value < 1:
        raise InvalidRequest(f"size {text!r} must be at least one byte", "kv_cache_memory")
    return int(value)
