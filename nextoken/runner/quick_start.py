"""The first token of ``nextoken run`` before PyTorch is imported.

Importing PyTorch takes longer on a small CPU than a small model's whole prompt. For a model
whose weights are already in the prepared-weights cache (`loader.prepared`), everything the first
token needs is torch-free: the GGUF metadata, config and tokenizer (`loader.gguf`, `tokenizer`),
the prepared file mapped with NumPy (`loader.prepared.PreparedFile`: the codes, the norms and
biases, RoPE's frequencies, as the engine's model holds them) and our C kernels. `first_token`
runs the prompt through the engine's one-call decode step (`kernels.decode_step`, the module
`layers.native_decode` calls too), in calls of at most `decode_step.ROWS_PER_CALL` tokens:
within a call each row is one prompt position, at ``slot = position``, attending to
``position + 1`` keys, the keys and values of a call being written before any row attends, so
the call is a causal prefill. Then the final
norm, the LM head and the sampler's draw (`sample.draw`: the same kernel, one uniform number
from the request's seeded stream, `sample.rng`), as the engine would.

The command prints that token at once. When generation goes on, the engine is built as usual
(`LLM.from_engine_args(args, first=...)`: the GGUF file and tokenizer read here are reused) and
runs the request as `LLM.generate` would, with that token chosen already (`LLM.stream(...,
first=...)`: its prefill, then the token emitted without a draw, the seeded stream past the
number it used). The engine prefills a prompt this short with the same call
(`NativeDecoder.takes`), so the logits are the engine's bit for bit and ``nextoken run --seed
S`` prints the text `LLM.generate` gives for seed S.

It runs only where it is the engine's arithmetic: GGUF weights all cached as codes, layers
``decode.c`` implements (`decode_step.serves`), bf16 with a bf16 KV cache, one sequence, a prompt
of at most `MAX_PROMPT_TOKENS`, and sampling settings whose first token needs no history (no
penalties, bias, minimum length, stop strings, logprobs, grammar or watermark): each field of
`SamplingParams` and `EngineArgs` says with which values it keeps the first token (its
``quick_start`` mark, `keeps_first_token`); an unmarked field must have its default. Anything
else, and any failure here, returns None: the command then runs the engine alone, which reports
errors.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import logging
import os
from dataclasses import dataclass

import numpy as np

from nextoken.kernels.decode_step import MAX_PREFILL_TOKENS, ROWS_PER_CALL
from nextoken.loader.opened import OpenedModel

log = logging.getLogger(__name__)

# longer prompts go to the engine: it prefills them with its PyTorch layers, whose arithmetic
# (attention) differs from the decode step's by bf16 rounding; up to this bound its prefill is
# this same call (`layers.native_decode.NativeDecoder.takes`)
MAX_PROMPT_TOKENS = MAX_PREFILL_TOKENS


@dataclass
class FirstToken:
    """What `first_token` computed: the prompt's ids, the token drawn, its text (what the
    engine's detokenizer would stream for it), whether the sequence ends there, the seconds it
    took, how many uniform numbers its draw took from the seeded stream (0 greedy, else 1) and
    the GGUF file and tokenizer read (`opened`), which the engine takes over
    (`LLM.from_engine_args(args, first=...)`)."""

    prompt_ids: list[int]
    token: int
    text: str
    finished: bool
    seconds: float = 0.0
    draws: int = 0
    opened: OpenedModel | None = None


class PromptKV:
    """The prompt's keys and values as the decode step writes them: bf16 bits, k and v
    ``[layers, Hkv, blocks, block_size, head_dim]`` (the engine's `PagedKVCache` layout, one
    block per `block_size` positions in order)."""

    def __init__(self, cfg, num_tokens: int, block_size: int):
        self.block_size = block_size
        shape = (cfg.num_layers, cfg.num_kv_heads, -(-num_tokens // block_size), block_size, cfg.head_dim)
        self.k = np.zeros(shape, dtype=np.uint16)
        self.v = np.zeros(shape, dtype=np.uint16)


def keeps_first_token(args) -> bool:
    """Whether every field of `args` (`SamplingParams` or `EngineArgs`) has a value with which
    this path draws the engine's first token: its default, or one its ``quick_start`` mark allows
    (True: any value; a tuple: those). A field without the mark must have its default, so a new
    option keeps the quick start off until it is marked."""
    for f in dataclasses.fields(args):
        mark, value = f.metadata.get("quick_start", False), getattr(args, f.name)
        if mark is True or (isinstance(mark, tuple) and value in mark):
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        empty = isinstance(value, (list, tuple, dict, str)) and not value and not default  # stop: [] for None
        if value != default and not empty:
            return False
    return True


def _engine_allows(e) -> bool:
    """Whether these `EngineArgs` run the model as this path does: each field as its mark allows,
    and on the CPU (``--device cpu``, or ``auto`` on a machine that shows no NVIDIA device, read
    without importing PyTorch)."""
    return keeps_first_token(e) and (e.device == "cpu" or not glob.glob("/dev/nvidia[0-9]*"))


def model_file(model: str) -> str | None:
    """The GGUF file `--model` names when it is already on disk (a path or a cached catalog
    model), else None (a pull, a folder or a hub id: the engine's business)."""
    from nextoken.catalog import CATALOG, is_cached, model_path

    if model.endswith(".gguf") and os.path.isfile(model):
        return model
    if model in CATALOG and is_cached(model):
        return str(model_path(model))
    return None


def first_token(prompt: str, engine_args, params, chat: bool, system: str | None = None) -> FirstToken | None:
    """The first token for `prompt` as ``nextoken run`` would draw it, without PyTorch, or None
    when this path does not apply (see the module docstring). `chat`: apply the chat template
    when the model has one."""
    import time

    from nextoken.errors import ModelLoadError
    from nextoken.kernels import native_allowed

    t0 = time.perf_counter()
    try:
        if not (keeps_first_token(params) and _engine_allows(engine_args) and native_allowed()):
            return None
        path = model_file(engine_args.model)
        if path is None:
            return None
        out = _run(path, prompt, engine_args, params, chat, system)
    except ModelLoadError:  # a damaged GGUF file: the engine's reader (the same) would say the same, later
        raise
    except Exception as exc:  # never worse than the engine: it runs next and reports what is wrong
        log.info("quick start skipped (%s: %s)", type(exc).__name__, exc)
        return None
    if out is not None:
        out.seconds = time.perf_counter() - t0
        log.info("quick start: first token in %.3f s, before PyTorch was imported", out.seconds)
    return out


def _run(path, prompt, engine_args, params, chat, system) -> FirstToken | None:
    from nextoken.kernels import load
    from nextoken.kernels.decode_step import PLAIN_ARCHITECTURES, serves
    from nextoken.loader.gguf import GGUFFile, read_model_config
    from nextoken.loader.prepared import merges_path
    from nextoken.sample.draw import draw_one
    from nextoken.sample.rng import DrawGenerator
    from nextoken.tokenizer import Tokenizer
    from nextoken.tokenizer.chat_template import chat_prompt

    f = GGUFFile(path)  # the header and tokenizer first: the file's hash (the cache's key) is
    cfg = read_model_config(f)  # being computed on another thread meanwhile (`loader.prepared`)
    if not serves(cfg) or cfg.architecture not in PLAIN_ARCHITECTURES or cfg.sliding_layers:
        return None  # (the engine's decode step runs Gemma's and Qwen 3's layers; this reads Llama's)
    tok = Tokenizer.from_gguf(f, merges_path(path))  # (the prepared cache is this path's condition)
    if chat and tok.chat_template is not None:
        prompt = chat_prompt(tok, prompt, system)
    ids = tok.encode(prompt)
    ctx = min(cfg.context_length, engine_args.max_model_len or cfg.context_length)
    if not ids or len(ids) + params.max_tokens > ctx or any(not 0 <= t < cfg.vocab_size for t in ids):
        return None  # the engine says what is wrong, or truncates (truncate_prompt)
    if len(ids) > MAX_PROMPT_TOKENS:
        return None
    params = params.validate(cfg.vocab_size)
    sampling = load("sampling")
    if not prepared_path(path).is_file() or sampling is None:
        return None  # the first load packs the codes and writes the cache
    _set_threads(engine_args.num_threads)
    kv = PromptKV(cfg, len(ids), engine_args.block_size)
    logits = prompt_logits(f, cfg, ids, kv)
    if logits is None:
        return None
    draws = 0 if params.greedy else 1
    token = draw_one(sampling, logits, params, DrawGenerator(params.seed).uniform() if draws else 0.0)
    first = _finish(tok, ids, token, params)
    if first is not None:
        first.draws, first.opened = draws, OpenedModel(f, tok)
    return first


def _set_threads(n: int | None) -> None:
    """The OpenMP threads of our kernels (PyTorch is not there to set them)."""
    from nextoken.runner.threads import default_threads

    try:
        ctypes.CDLL("libgomp.so.1").omp_set_num_threads(ctypes.c_int(n or default_threads()))
    except (OSError, AttributeError):
        pass


def prepared_path(path: str):
    """Where the prepared-weights cache of the GGUF file at `path` is (`loader.prepared`)."""
    from nextoken.catalog import cache_dir
    from nextoken.loader.prepared import LAYOUT_VERSION, file_key

    return cache_dir() / "prepared" / f"{file_key(path)}-v{LAYOUT_VERSION}.safetensors"


class _Weights:
    """The model's tensors in the prepared file, as the engine's model holds them: `codes(name)`
    a weight's `QW` (its arrays kept alive here), `dense(name)` a norm's bf16 bits or RoPE's
    float32 frequencies, `bias(name)` a bias widened to float32 (as `Linear.qweight_c` does).
    Raises `KeyError` for a tensor the file lacks."""

    def __init__(self, prepared):
        self.file, self.keep = prepared, []

    def dense(self, name: str) -> np.ndarray:
        a = self.file.array(name)
        if a is None:
            raise KeyError(f"{name} is not in the prepared-weights cache")
        return a

    def bias(self, name: str) -> np.ndarray:
        b = self.dense(name)
        b = (b.astype(np.uint32) << 16).view(np.float32) if self.file.dtype(name) == "BF16" else b.astype(np.float32)
        self.keep.append(b)
        return b

    def codes(self, name: str, bias: np.ndarray | None = None):
        from nextoken.kernels.structs import QW, lut_codes

        if name not in self.file.params:
            raise KeyError(f"{name} is not in the prepared-weights cache")
        offset, bits, group, gps, lut = self.file.params[name]
        arrays = [self.file.array(f"{name}/{f}") for f in ("codes", "scales", "mins", "scale_sup", "min_sup")]
        rows, cols = arrays[1].shape[0] * 16, arrays[1].shape[1] * int(group)
        if arrays[0].nbytes * 8 != rows * cols * int(bits):
            raise ValueError(f"{name}: its codes do not match its shape")
        self.keep.append(arrays)
        ptrs = [a.ctypes.data if a is not None else None for a in (*arrays, bias)]
        return QW(*ptrs, float(offset), int(bits), int(group), int(gps), rows, cols, lut_codes(int(lut)))


def prompt_logits(f, cfg, ids: list[int], kv: PromptKV | None = None) -> np.ndarray | None:
    """float32 logits ``[vocab]`` of the token after the prompt `ids`, from the GGUF file `f`
    (`loader.gguf.GGUFFile`, config `cfg`) and its prepared-weights cache, by our C kernels
    alone, writing the prompt's keys and values to `kv` (a fresh `PromptKV` of 16-token blocks
    when None). None when the decode kernel is unavailable or refuses a shape. Raises OSError,
    ValueError or KeyError for a cache that is missing, stale or lacks a tensor."""
    from nextoken.kernels import load
    from nextoken.kernels.decode_step import decode_layers, layer_table
    from nextoken.loader.gguf_names import GGUF_EMBEDDING, GGUF_OUTPUT, GGUF_OUTPUT_NORM, GGUF_PROJECTIONS, \
        layer_projection
    from nextoken.loader.prepared import PREPARED_INV_FREQ, PreparedFile, file_key

    lib = load("decode")
    if lib is None:
        return None
    w = _Weights(PreparedFile(str(prepared_path(f.path)), file_key(f.path)))
    n, hidden = len(ids), cfg.hidden_size
    kv = kv or PromptKV(cfg, n, 16)
    num_blocks, block = kv.k.shape[2], kv.block_size
    layers = []
    for i in range(cfg.num_layers):
        projections = []
        for g in GGUF_PROJECTIONS:
            bias = None
            if cfg.attention_bias and g in ("attn_q", "attn_k", "attn_v"):
                bias = w.bias(layer_projection(i, g, "bias"))
            projections.append(w.codes(layer_projection(i, g), bias))
        norms = w.dense(f"blk.{i}.attn_norm.weight"), w.dense(f"blk.{i}.ffn_norm.weight")
        layers.append((norms[0].ctypes.data, norms[1].ctypes.data, projections, kv.k[i].ctypes.data,
                       kv.v[i].ctypes.data, None, None))
    table = layer_table(layers)
    embed = w.codes(GGUF_EMBEDDING)
    head = embed if cfg.tie_word_embeddings else w.codes(GGUF_OUTPUT)
    if embed.K != hidden or head.N < cfg.vocab_size:
        return None
    inv_freq = w.dense(PREPARED_INV_FREQ)
    blocks = np.arange(num_blocks, dtype=np.int64)
    i64, p = ctypes.c_int64, ctypes.c_void_p
    h = None
    for start in range(0, n, ROWS_PER_CALL):
        chunk = np.asarray(ids[start : start + ROWS_PER_CALL], dtype=np.int64)
        t = len(chunk)
        h = np.empty((t, hidden), dtype=np.uint16)
        if lib.qlookup_bf16(ctypes.byref(embed), p(chunk.ctypes.data), i64(t), p(h.ctypes.data)) != 0:
            return None
        positions = np.arange(start, start + t, dtype=np.int64)
        tables = np.ascontiguousarray(np.broadcast_to(blocks, (t, num_blocks)))
        lens = positions + 1
        if decode_layers(lib, table, cfg, h.ctypes.data, t, inv_freq.ctypes.data, positions.ctypes.data,
                         positions.ctypes.data, tables.ctypes.data, num_blocks, lens.ctypes.data, num_blocks,
                         block) != 0:
            return None
    last = np.ascontiguousarray(h[-1:])
    normed = np.empty_like(last)
    final_norm = w.dense(GGUF_OUTPUT_NORM)
    lib.rms_norm_rows_bf16(p(last.ctypes.data), p(final_norm.ctypes.data), i64(1), i64(hidden),
                           ctypes.c_float(cfg.norm_eps), p(normed.ctypes.data))
    logits = np.empty((1, head.N), dtype=np.uint16)
    if lib.qmatmul(p(normed.ctypes.data), ctypes.c_int(1), i64(1), ctypes.byref(head), p(logits.ctypes.data),
                   ctypes.c_int(1), i64(head.N)) != 0:
        return None
    return (logits[0, : cfg.vocab_size].astype(np.uint32) << 16).view(np.float32)  # bf16 -> float32, exact


def _finish(tok, ids: list[int], token: int, params) -> FirstToken | None:
    """The streamed text of `token` and whether the sequence ends with it, as the engine's
    output processing decides (end-of-generation token, max_tokens); None when its text is an
    unfinished UTF-8 sequence that only later tokens complete (the engine then starts over)."""
    from nextoken.tokenizer.detokenizer import IncrementalDetokenizer

    finished = params.max_tokens <= 1 or (token in tok.eog_token_ids and not params.ignore_eos)
    detok = IncrementalDetokenizer(tok, params.skip_special_tokens)
    detok.add_token(token)
    if finished:
        detok.flush()
    elif detok.pending:
        return None
    return FirstToken(ids, token, detok.emit(finished=True), finished)
