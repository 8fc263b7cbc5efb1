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

import dataclasses
from dataclasses import dataclass

from nextoken.catalog import DEFAULT_MODEL
from nextoken.cli_args import CliArgs, json_object, opt, parse_size
from nextoken.config import KV_CACHE_DTYPES, QUANTIZATIONS, SCHEDULING_POLICIES, CacheConfig
from nextoken.errors import InvalidRequest

DTYPE_CHOICES = ("auto", "bfloat16", "float32", "bf16", "fp32")
ATTENTION_BACKENDS = ("auto", "native", "torch", "triton")
SPECULATIVE_METHODS = ("draft", "ngram")
DISK_OFF = ("off", "none", "")  # --kv-cache-dir values that turn the disk tier off


@dataclass
class EngineArgs(CliArgs):
    """Everything that decides how an engine is built and runs. Construct it directly (Python),
    or with `from_cli_args`; either way `validate` runs, and a bad value raises `InvalidRequest`
    naming the field."""

    model: str = opt(DEFAULT_MODEL, "catalog name (see `nextoken models`), path to a .gguf file or a Hugging Face "
                      "model folder, or a hub id org/name from the huggingface_hub cache", flag="--model",
                     short="-m", metavar="NAME|PATH", quick_start=True)
    dtype: str = opt("auto", "weights and activations dtype: auto (bfloat16 for GGUF; a Hugging Face folder's "
                      "config dtype), bfloat16, or float32 (the exact reference)", choices=DTYPE_CHOICES,
                      quick_start=("auto", "bfloat16", "bf16"))
    device: str = opt("auto", "where the model runs: auto (CUDA when PyTorch sees a GPU, else the CPU), cpu, cuda "
                      "or cuda:N", metavar="DEVICE", quick_start=("auto", "cpu"))
    num_threads: int | None = opt(None, "compute threads (default: one per core this process may use, at "
                                        "most OMP_NUM_THREADS)", flag="--threads", type=int, quick_start=True)
    enforce_eager: bool = opt(False, "on the CPU, PyTorch only, none of nextoken's C kernels (the reference path); on "
                               "a GPU, no CUDA graphs (every decode step launched op by op) and none of our kernels "
                               "but the attention (PyTorch's norms, activations, RoPE, matmuls and draw; the "
                               "attention's default tiles, untimed); fixed at load in the execution plan", cli="true")
    reference_attention: bool = opt(False, "plain float32 attention (the reference) instead of the fast paths",
                                     cli="true")
    attention_backend: str = opt("auto", "attention's code: auto (the device's fastest: our C kernels on the CPU, "
                                 "Triton on a GPU), native (C), torch (PyTorch), or triton (on the CPU only under "
                                 "Triton's interpreter, TRITON_INTERPRET=1: a slow check of the GPU path)",
                                 choices=ATTENTION_BACKENDS)
    batch_invariant: bool = opt(False, "a request's logits do not depend on the other requests in its batch: every "
                                 "linear and RMSNorm on batch-invariant Triton kernels (one tile shape for every "
                                 "batch size, no split-K) and one key split per decode (He et al. 2025, "
                                 "\"Defeating Nondeterminism in LLM Inference\"). The GPU path's, at some decode "
                                 "speed; not with LoRA adapters", cli="true")
    dense_weights: bool = opt(False, "with --enforce-eager (PyTorch's int4 kernel), also keep bf16 copies of "
                               "int4-packed weights for calls of many rows (about 4x the weight memory)", cli="bool")
    tensor_parallel_size: int = opt(1, "processes the model is split across (Megatron-style: heads, feed-forward "
                                     "columns and vocabulary; one all-reduce after attention and after the MLP). "
                                     "Alone, rank 0 starts the others on this machine, each on its own cores; across "
                                     "hosts, launch with torchrun --nproc-per-node N --nnodes ... (-tp N, as vLLM)",
                                     type=int, short="-tp")
    auto_pull: bool = opt(True, "download a catalog model on first use", cli="none", quick_start=True)
    trust_remote_code: bool = opt(False, "accepted as vLLM's command line and `LLM(...)` take it, and changes nothing: "
                                         "no code from a model's repository runs here (the architectures are built in)",
                                  cli="true", quick_start=True)
    quantization: str | None = opt(None, "quantize a Hugging Face folder's linear and embedding weights at load "
                                   "into GGUF blocks run by our kernels (the gguf package's quantizers: the bytes "
                                   "llama.cpp writes); kept in the prepared-weights cache, so only the first start "
                                   "quantizes", choices=QUANTIZATIONS, quick_start=True)
    prepared_cache: bool = opt(True, "keep GGUF weights repacked for our kernels (and a SentencePiece vocabulary's "
                                "merges) in <cache>/prepared (keyed by the file's SHA-256) and memory-map them on "
                                "later starts", cli="bool")
    huge_pages: bool = opt(True, "on the CPU, move the linear weights after loading into one arena of 2 MiB pages "
                            "(Linux transparent huge pages): decode reads them faster (Qwen2.5-0.5B 46 -> 57 tok/s on a "
                            "VM), for a copy at load (1-3.5 s per GiB on a VM); off for `run` and `explain`, whose one "
                            "short answer does not repay it", cli="bool", quick_start=True)
    # KV cache
    max_model_len: int | None = opt(None, "most tokens per sequence, prompt + output (default: the model's "
                                     "context length); also sizes the default KV cache", group="KV cache", type=int,
                                     quick_start=True)
    kv_cache_memory: int | None = opt(None, "bytes for the KV cache, e.g. 512MiB or 2GB (default: max_num_seqs "
                                       "full contexts, at most a quarter of free memory and 1 GiB)",
                                       group="KV cache", cli="size", quick_start=True)
    gpu_memory_utilization: float = opt(0.9, "on a GPU, the share of its memory this engine may take: weights, "
                                         "activations and the KV cache, which gets what the weights and a profiling "
                                         "pass leave (vLLM's)", group="KV cache", type=float, quick_start=True)
    num_kv_blocks: int = opt(0, "KV cache blocks, overriding --kv-cache-memory (0: from the memory budget)",
                              group="KV cache", type=int, quick_start=True)
    block_size: int = opt(16, "tokens per KV cache block", group="KV cache", type=int, quick_start=True)
    kv_cache_dtype: str = opt("auto", "KV cache storage: auto (the model's dtype) or int8 (each token's key and "
                               "value rows per head as int8 with a float32 scale, the keys Hadamard-rotated first: about "
                               "half the bytes of bf16, so twice the tokens fit and long-context decode reads half "
                               "as much)",
                               group="KV cache", choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = opt(True, "reuse the KV of shared prompt prefixes", flag="--prefix-caching",
                                       group="KV cache", cli="bool", quick_start=True,
                                       aliases=("--enable-prefix-caching",))
    kv_cache_dir: str | None = opt(None, "a directory for the prefix cache's disk tier: full KV blocks are written "
                                   "there in the background and read back instead of recomputed, after a restart "
                                   "and by every process that shares the directory (default: off; with "
                                   "--kv-cache-disk alone or serve --replicas, <cache>/kv; off: none)",
                                   group="KV cache", metavar="DIR", quick_start=True)
    kv_cache_disk: int | None = opt(None, "most bytes the disk tier keeps, least recently used out first, e.g. "
                                    "20GiB (default: 8 GiB)", group="KV cache", cli="size", quick_start=True)
    # scheduler
    max_num_seqs: int | None = opt(None, "sequences running at once (default: 64 on the CPU; on a GPU vLLM's: 1024 "
                                    "with 70 GiB or more, except an A100, else 256)", group="scheduler", type=int,
                                    quick_start=True)
    max_num_batched_tokens: int | None = opt(None, "new tokens per step, prefill chunks and decodes (default: 2048; "
                                              "on a GPU of 70 GiB or more, except an A100, 8192: vLLM's)",
                                              group="scheduler", type=int, quick_start=True)
    enable_chunked_prefill: bool = opt(True, "split long prompts over several steps", flag="--chunked-prefill",
                                        group="scheduler", cli="bool", quick_start=True,
                                        aliases=("--enable-chunked-prefill",))
    async_scheduling: bool | None = opt(None, "overlap each step's host work (scheduling, the next pass's inputs, "
                                        "detokenizing and stop checks) with the device's pass: a step is launched "
                                        "before the last one's tokens are read back, its decodes taking them on the "
                                        "device (vLLM's). Default: on a GPU (1.2-1.5x its decode speed on an H200), "
                                        "off on the CPU (no gain there); a request with a grammar, logit processors, "
                                        "tracing or prompt logprobs, beam search or speculative decoding runs the "
                                        "steps in order", group="scheduler", cli="bool", quick_start=True)
    scheduling_policy: str = opt("fcfs", "the order waiting requests are admitted in: fcfs (arrival), priority (each "
                                 "request's priority, lower first, as vLLM; a higher priority preempts a lower "
                                 "one) or fair (clients share the tokens served: the Virtual Token Counter)",
                                 group="scheduler", choices=SCHEDULING_POLICIES, quick_start=True)
    # speculative decoding
    speculative_model: str | None = opt(None, "draft model (catalog name, .gguf or folder) with the target's "
                                         "vocabulary", group="speculative decoding", metavar="MODEL")
    speculative_method: str | None = opt(None, "draft (needs --speculative-model) or ngram (prompt lookup, no "
                                          "second model)", group="speculative decoding", choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = opt(4, "tokens proposed per step", group="speculative decoding", type=int,
                                      quick_start=True)
    speculative_draft_vocab: int = opt(32768, "the draft's head scores the first N token ids and the special tokens "
                                       "only, where the vocabulary has 2N or more (FR-Spec: a cheaper draft step; the "
                                       "target's output is unchanged); 0: the whole vocabulary",
                                       group="speculative decoding", type=int, metavar="N")
    # LoRA
    enable_lora: bool = opt(False, "let requests use LoRA adapters (PEFT folders): vLLM's LoRARequest in Python, "
                             "--lora-modules and model: NAME on the server", group="LoRA", cli="true", quick_start=True)
    max_loras: int = opt(1, "adapters loaded at once", group="LoRA", type=int, quick_start=True)
    max_lora_rank: int = opt(16, "highest adapter rank accepted", group="LoRA", type=int, quick_start=True)
    # output
    watermark_gamma: float = opt(0.5, "share of the vocabulary on each green list of the watermark (requests "
                                  "with watermark on)", group="output", type=float, quick_start=True)
    watermark_delta: float = opt(2.0, "what the watermark adds to a green token's logit", group="output",
                                  type=float, quick_start=True)
    seed: int | None = opt(None, "seeds the requests that set none, in the order they arrive: a fresh engine given "
                           "the same requests in the same order samples the same text (vLLM's; without it their "
                           "seeds are random). On run, chat and explain --seed is the request's own",
                           group="output", type=int)
    generation_config: str = opt("auto", "the sampling defaults of requests that leave temperature, top_p, top_k, "
                                 "min_p or repetition_penalty unset, and a bound on every output (max_new_tokens): "
                                 "auto (the model folder's generation_config.json, as vLLM; a GGUF file has none), "
                                 "vllm (none) or a folder holding such a file", group="output", metavar="auto|vllm|DIR",
                                 quick_start=True)
    override_generation_config: dict | None = opt(None, "such defaults over the model's, as JSON, e.g. "
                                                  "'{\"temperature\": 0.5}' (vLLM's)", group="output",
                                                  type=json_object, metavar="JSON", quick_start=True)
    max_logprobs: int = opt(20, "most log-probabilities a request may ask for: logprobs and prompt_logprobs "
                            "(chat's top_logprobs); -1: the whole vocabulary (vLLM's)", group="output", type=int,
                            metavar="N", quick_start=True)
    chat_template: str | None = opt(None, "a Jinja chat template file to use instead of the model's (e.g. one "
                                     "with tool support)", group="output", metavar="FILE")
    stream_interval: int = opt(1, "a streamed request's outputs: its first token at once, then one output per N "
                               "new tokens (and its last): fewer, larger chunks cost the server less per token "
                               "under load (vLLM's)", group="output", type=int, quick_start=True)

    def __post_init__(self):
        for name in ("kv_cache_memory", "kv_cache_disk"):  # Python callers may write sizes as on the command line
            if isinstance(getattr(self, name), str):
                setattr(self, name, parse_size(getattr(self, name), name))
        self.validate()

    # -- checks ---------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise `InvalidRequest` naming the first field whose value is out of range."""
        if not isinstance(self.model, str) or not self.model:
            raise InvalidRequest("model must be a non-empty name or path", "model")
        if self.dtype not in DTYPE_CHOICES:
            raise InvalidRequest(f"dtype {self.dtype!r} is not supported; choose from {', '.join(DTYPE_CHOICES)}",
                                 "dtype")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise InvalidRequest(f"quantization {self.quantization!r} is not supported; choose from "
                                 f"{', '.join(QUANTIZATIONS)}", "quantization")
        if not isinstance(self.device, str) or not _device_name_ok(self.device):
            raise InvalidRequest(f"device {self.device!r} is not one of auto, cpu, cuda, cuda:N", "device")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise InvalidRequest(f"attention_backend {self.attention_backend!r} is not supported; choose from "
                                 f"{', '.join(ATTENTION_BACKENDS)}", "attention_backend")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise InvalidRequest(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}",
                                 "gpu_memory_utilization")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequest(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; choose from "
                                 f"{', '.join(KV_CACHE_DTYPES)}", "kv_cache_dtype")
        for name, low in (("num_threads", 1), ("tensor_parallel_size", 1), ("max_model_len", 1), ("kv_cache_memory", 1),
                          ("kv_cache_disk", 1), ("num_kv_blocks", 0),
                          ("block_size", 1), ("max_num_seqs", 1), ("max_num_batched_tokens", 1), ("max_loras", 1),
                          ("max_lora_rank", 1),
                          ("num_speculative_tokens", 1), ("speculative_draft_vocab", 0), ("stream_interval", 1),
                          ("max_logprobs", -1)):
            value = getattr(self, name)
            if value is None and name in ("num_threads", "max_model_len", "kv_cache_memory", "kv_cache_disk",
                                          "max_num_seqs", "max_num_batched_tokens"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidRequest(f"{name} must be an integer >= {low}, got {value!r}", name)
        for f in dataclasses.fields(self):
            if f.metadata["cli"] in ("true", "bool") or f.name == "auto_pull":
                value = getattr(self, f.name)
                if not isinstance(value, bool) and not (value is None and f.default is None):  # (None: the default)
                    raise InvalidRequest(f"{f.name} must be True or False, got {value!r}", f.name)
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise InvalidRequest(f"generation_config must be auto, vllm or a folder, got {self.generation_config!r}",
                                 "generation_config")
        if self.override_generation_config is not None and not isinstance(self.override_generation_config, dict):
            raise InvalidRequest("override_generation_config must be a dictionary of sampling defaults, got "
                                 f"{self.override_generation_config!r}", "override_generation_config")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidRequest(f"seed must be an integer, got {self.seed!r}", "seed")
        for name, ok, rule in (("watermark_gamma", lambda v: 0 < v < 1, "in (0, 1)"),
                               ("watermark_delta", lambda v: 0 < v <= 100, "in (0, 100]")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise InvalidRequest(f"{name} must be a number {rule}, got {value!r}", name)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidRequest(f"scheduling_policy {self.scheduling_policy!r}: choose from "
                                 f"{', '.join(SCHEDULING_POLICIES)}", "scheduling_policy")
        if self.speculative_method is not None and self.speculative_method not in SPECULATIVE_METHODS:
            raise InvalidRequest(f"unknown speculative method {self.speculative_method!r}: use 'draft' or 'ngram'",
                                 "speculative_method")
        if self.speculative_method == "draft" and self.speculative_model is None:
            raise InvalidRequest("speculative method 'draft' needs speculative_model", "speculative_model")
        if self.speculative_method == "ngram" and self.speculative_model is not None:
            raise InvalidRequest("speculative method 'ngram' takes no speculative_model", "speculative_model")

    @property
    def disk_dir(self) -> str | None:
        """The disk tier's directory: `kv_cache_dir`, or ``<cache>/kv`` when only `kv_cache_disk`
        is given; None when the tier is off (neither given, or `kv_cache_dir` ``off``)."""
        if self.kv_cache_dir is None and self.kv_cache_disk is None or self.kv_cache_dir in DISK_OFF:
            return None
        if self.kv_cache_dir is not None:
            return self.kv_cache_dir
        from nextoken.catalog import cache_dir

        return str(cache_dir() / "kv")

    def cache_config(self) -> CacheConfig:
        """The KV cache's settings (`config.CacheConfig`), the disk tier's included."""
        return CacheConfig(self.block_size, self.num_kv_blocks, self.kv_cache_memory, self.enable_prefix_caching,
                           self.kv_cache_dtype, self.disk_dir, self.kv_cache_disk)

    @property
    def speculative(self) -> str | None:
        """The speculative method in force (a draft model alone means ``"draft"``), or None."""
        if self.speculative_method is None and self.speculative_model is None:
            return None
        return self.speculative_method or "draft"

    def replace(self, **changes) -> EngineArgs:
        return dataclasses.replace(self, **changes)


def _device_name_ok(name: str) -> bool:
    """Whether `name` is a device this option takes: auto, cpu, cuda or cuda:N."""
    kind, _, index = name.partition(":")
    return name in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit())


def options_table(args_cls: type[CliArgs] = EngineArgs, overrides: dict[str, str] | None = None) -> str:
    """The Markdown table of every field of `args_cls` that has a flag (flag, Python keyword,
    default, help), in field order: the README's engine-options table is this text
    (tests/cli/test_docs.py keeps them equal; ``python -m nextoken.engine_args`` prints it).
    `overrides`: a field's default as the table shows it, where the value alone would not say."""
    shown = {"model": f"`{DEFAULT_MODEL}`", "num_threads": "one per usable core",
             "max_model_len": "the model's context", "kv_cache_memory": "from free memory",
             "kv_cache_dir": "off", "kv_cache_disk": "8 GiB",
             "num_kv_blocks": "from the memory", "speculative_method": "`draft` with a model",
             "async_scheduling": "on a GPU", "max_num_seqs": "64; a GPU's: 256 or 1024",
             "max_num_batched_tokens": "2048; 8192 on a large GPU", "huge_pages": "on; `run`, `explain`: off",
             **(overrides or {})}
    rows = ["| flag | keyword | default | what |", "|---|---|---|---|"]
    for f in args_cls.cli_fields():
        kind, flag = f.metadata["cli"], args_cls.flag(f)
        if kind == "bool":
            flag = " / ".join(f"{name} / --no-{name[2:]}" for name in (flag, *f.metadata["aliases"]))
        elif kind != "true":
            extra = f.metadata["argparse"]
            if extra.get("choices"):
                flag += " {" + ",".join(extra["choices"]) + "}"
            else:
                flag += " " + (extra.get("metavar") or ("SIZE" if kind == "size" else "N" if extra.get("type") is int
                                                        else "VALUE"))
        default = shown.get(f.name) or ("on" if f.default is True else "off" if f.default is False
                                       else "none" if f.default is None else f"`{f.default}`")
        text = f.metadata["help"].replace("|", "\\|")
        flag = flag.replace("|", "\\|")
        rows.append(f"| `{flag}` | `{f.name}` | {default} | {text} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(options_table(), end="")
