"""The first token of ``nextoken run`` before PyTorch is imported.

Importing PyTorch takes 1.2-2 s on a small CPU, more than llama.cpp needs to load SmolLM2 and
run a 128-token prompt. For a model whose weights are already in the prepared-weights cache
(`loader.prepared`), everything the first token needs is torch-free: the GGUF metadata, config
and tokenizer (`loader.gguf`, `tokenizer`), the cached codes (memory-mapped here with NumPy),
and our C kernels (ctypes). `first_token` runs the prompt through ``kernels/decode.c``'s
``decode_layers`` (the same layer stack the engine's decode step calls), in chunks of
`CHUNK` tokens: within a call each row is one prompt position, at ``slot = position``, and
attends to ``position + 1`` keys, the keys and values of a chunk being written before any row
attends, so the chunk is a causal prefill. Then the final norm and the LM head (the same
kernels), and the sampler's rules in NumPy: greedy argmax, or temperature, top-k, top-p, min-p
and a draw (``numpy.random.Generator`` seeded by ``--seed``: the same seed gives the same
first token, though not the draw PyTorch's generator would make).

The command prints that token at once. When generation goes on, the engine is built as usual,
reusing the GGUF file and tokenizer read here, takes the prompt's keys and values into its
prefix cache (`LLMEngine.import_prefix`: the full blocks) and continues from the prompt plus
that token (`continuation`): every later token is the engine's. On this VM (2 cores, 128-token
prompt) the first token came after 0.46 s instead of 1.63 s for SmolLM2 and 2.1 s instead of
2.8 s for Qwen2.5-1.5B; the whole answer of 32 tokens took 0.2-0.5 s longer, since nothing of
the engine's start (importing PyTorch above all) overlaps the prompt's pass any more.
Importing PyTorch on a thread during the pass was tried and made both worse (the import holds
the GIL and a core the kernels need).

The first token comes from our decode kernel's attention rather than the prefill's, which
rounds differently (as the engine's own prefill and decode paths do): a greedy answer can part
from ``--no-quick-start``'s where two tokens are within rounding of each other.

It runs only where it is the engine's arithmetic: GGUF weights all cached as codes, a Llama or
Qwen2 layer (`QUICK_ARCHITECTURES`, the layers ``decode.c`` implements), bf16 with a bf16 KV
cache, one sequence, a prompt of at most `MAX_PROMPT_TOKENS`, and sampling settings whose
first token needs no history (no penalties, bias, minimum length, stop strings, logprobs,
grammar or watermark). Anything else, and any failure here, returns None: the command then runs
the engine alone, which reports errors.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import mmap
import os
from dataclasses import dataclass

import numpy as np

log = logging.getLogger(__name__)

QUICK_ARCHITECTURES = ("llama", "qwen2")  # architectures whose layer ``kernels/decode.c`` implements
CHUNK = 256  # prompt tokens per decode_layers call (bounds its buffers)
# Longer prompts go to the engine: the decode kernel attends one row at a time, where the
# prefill's kernels batch the rows. On this VM SmolLM2's prompt ran at 1104 tok/s here for 512
# tokens (the engine's prefill: about 1400), 645 for 2048 and 475 for 4096; Qwen2.5-1.5B's at
# 185 for 512 (the engine: about 200) and 159 for 1024.
MAX_PROMPT_TOKENS = 512
_PROJ = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
         "down": "ffn_down"}
_ST_DTYPES = {"U8": np.uint8, "I8": np.int8, "F16": np.float16, "F32": np.float32, "BF16": np.uint16}


@dataclass
class FirstToken:
    """What `first_token` computed: the prompt's ids, the token drawn, its text (what the
    engine's detokenizer would stream for it), whether the sequence ends there, and the seconds
    it took from the call."""

    prompt_ids: list[int]
    token: int
    text: str
    finished: bool
    seconds: float
    kv: PromptKV | None = None  # the prompt's keys and values (`LLMEngine.import_prefix` takes them)
    opened: tuple | None = None  # (GGUFFile, Tokenizer) for `LLMEngine.from_engine_args`: not read twice


class PromptKV:
    """The prompt's keys and values as this path computed them: bf16 bits, k and v
    ``[layers, Hkv, blocks, block_size, head_dim]`` (the engine's `PagedKVCache` layout, one
    block per `block_size` positions in order)."""

    def __init__(self, cfg, num_tokens: int, block_size: int):
        self.block_size = block_size
        shape = (cfg.num_layers, cfg.num_kv_heads, -(-num_tokens // block_size), block_size, cfg.head_dim)
        self.k = np.zeros(shape, dtype=np.uint16)
        self.v = np.zeros(shape, dtype=np.uint16)


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), rounded to nearest even as PyTorch's cast (NaN kept)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def bf16_to_f32(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.uint32) << 16).view(np.float32)


class PreparedArrays:
    """The prepared-weights cache file (safetensors) memory-mapped as NumPy arrays, with the
    metadata `loader.prepared` writes. Raises ValueError when its key or layout does not match."""

    def __init__(self, path: str, key: str, layout: int):
        with open(path, "rb") as fh:
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        n = int.from_bytes(self._map[:8], "little")
        header = json.loads(self._map[8 : 8 + n])
        meta = header.pop("__metadata__", {}) or {}
        if meta.get("key") != key or meta.get("layout") != str(layout):
            raise ValueError("its key does not match the model file")
        self.params = json.loads(meta["params"])  # name -> [offset, bits, group, gps]
        self._entries = header
        self._base = 8 + n

    def get(self, name: str) -> np.ndarray | None:
        e = self._entries.get(name)
        if e is None:
            return None
        start, end = e["data_offsets"]
        dtype = np.dtype(_ST_DTYPES[e["dtype"]])
        return np.frombuffer(self._map, dtype=dtype, count=(end - start) // dtype.itemsize,
                             offset=self._base + start).reshape(e["shape"])


class QuickWeight:
    """One weight's codes (arrays of the cache) and its ``qw_t``."""

    def __init__(self, cache: PreparedArrays, name: str, bias: np.ndarray | None = None):
        from nextoken.kernels.structs import QW

        if name not in cache.params:
            raise KeyError(f"{name} is not in the prepared-weights cache")
        offset, bits, group, gps = cache.params[name]
        self.arrays = [cache.get(f"{name}/{f}") for f in ("codes", "scales", "mins", "scale_sup", "min_sup")]
        self.bias = bias
        codes, scales = self.arrays[0], self.arrays[1]
        self.rows, self.cols = scales.shape[0] * 16, scales.shape[1] * int(group)
        ptr = [a.ctypes.data if a is not None else None for a in (*self.arrays, bias)]
        self.c = QW(*ptr, float(offset), int(bits), int(group), int(gps), self.rows, self.cols)
        if codes.nbytes * 8 != self.rows * self.cols * int(bits):
            raise ValueError(f"{name}: its codes do not match its shape")


def _params_allow(p) -> bool:
    """Whether the first token of these `SamplingParams` depends only on the logits."""
    return (p.n == 1 and p.logprobs is None and p.prompt_logprobs is None and p.min_tokens == 0
            and not p.stop and not p.stop_token_ids and not p.logit_bias and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty and p.structured_outputs is None
            and not p.watermark)


def _engine_allows(e) -> bool:
    """Whether these `EngineArgs` run the model as this path does."""
    return (e.dtype in ("auto", "bfloat16", "bf16") and not e.enforce_eager and not e.reference_attention
            and not e.dense_weights and e.tensor_parallel_size == 1 and e.prepared_cache
            and e.kv_cache_dtype == "auto" and e.speculative_model is None and e.speculative_method is None
            and e.chat_template is None)


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

    from nextoken.kernels import native_allowed

    t0 = time.perf_counter()
    try:
        if not (_params_allow(params) and _engine_allows(engine_args) and native_allowed()):
            return None
        path = model_file(engine_args.model)
        if path is None:
            return None
        out = _run(path, prompt, engine_args, params, chat, system)
    except Exception as exc:  # never worse than the engine: it runs next and reports what is wrong
        log.info("quick start skipped (%s: %s)", type(exc).__name__, exc)
        return None
    if out is not None:
        out.seconds = time.perf_counter() - t0
        log.info("quick start: first token in %.3f s, before PyTorch was imported", out.seconds)
    return out


def _run(path, prompt, engine_args, params, chat, system) -> FirstToken | None:
    from nextoken.loader.gguf import GGUFFile, read_model_config
    from nextoken.tokenizer import Tokenizer
    from nextoken.tokenizer.chat_template import chat_prompt

    f = GGUFFile(path)  # the header and tokenizer first: the file's hash (the cache's key) is
    cfg = read_model_config(f)  # being computed on another thread meanwhile (`loader.prepared`)
    if not supports(cfg):
        return None
    tok = Tokenizer.from_gguf(f)
    if chat and tok.chat_template is not None:
        prompt = chat_prompt(tok, prompt, system)
    ids = tok.encode(prompt)
    ctx = min(cfg.context_length, engine_args.max_model_len or cfg.context_length)
    if not ids or len(ids) + params.max_tokens > ctx or any(not 0 <= t < cfg.vocab_size for t in ids):
        return None  # the engine says what is wrong, or truncates (truncate_prompt)
    if len(ids) > MAX_PROMPT_TOKENS:
        return None
    params = params.validate(cfg.vocab_size)
    if not prepared_path(path).is_file():
        return None  # the first load packs the codes and writes the cache
    _set_threads(engine_args.num_threads)
    kv = PromptKV(cfg, len(ids), engine_args.block_size)
    logits = prompt_logits(f, cfg, ids, kv)
    if logits is None:
        return None
    first = _finish(tok, ids, sample(logits, params), params)
    if first is not None:
        first.kv, first.opened = kv, (f, tok)
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


def supports(cfg) -> bool:
    """Whether the layers of `cfg` (a `ModelConfig`) are the ones ``decode.c`` implements."""
    return (cfg.architecture in QUICK_ARCHITECTURES and not cfg.sliding_window and not cfg.extra
            and not (cfg.attention_bias and cfg.architecture == "llama"))  # llama's q/k rows are permuted


def prompt_logits(f, cfg, ids: list[int], kv: PromptKV | None = None) -> np.ndarray | None:
    """float32 logits ``[vocab]`` of the token after the prompt `ids`, from the GGUF file `f`
    (`loader.gguf.GGUFFile`, config `cfg`) and its prepared-weights cache, by our C kernels
    alone, writing the prompt's keys and values to `kv` (a fresh `PromptKV` of 16-token blocks
    when None). None when the decode kernel is unavailable or refuses a shape. Raises OSError,
    ValueError or KeyError for a cache that is missing, stale or lacks a weight."""
    from nextoken.kernels import load
    from nextoken.kernels.structs import DecodeLayer
    from nextoken.loader.prepared import LAYOUT_VERSION, file_key

    lib = load("decode")
    if lib is None:
        return None
    cache = PreparedArrays(str(prepared_path(f.path)), file_key(f.path), LAYOUT_VERSION)
    norm = lambda name: bf16(f.array(name))  # noqa: E731  (bf16 parameters, as the model holds them)
    keep = []  # every array the kernels point into
    n, hkv, d, hidden = len(ids), cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    kv = kv or PromptKV(cfg, n, 16)
    num_blocks, block = kv.k.shape[2], kv.block_size
    layers = []
    for i in range(cfg.num_layers):
        ws = {}
        for ours, g in _PROJ.items():
            bias = None
            if cfg.attention_bias and ours in ("q", "k", "v"):
                bias = bf16_to_f32(bf16(f.array(f"blk.{i}.{g}.bias")))
            ws[ours] = QuickWeight(cache, f"blk.{i}.{g}.weight", bias)
        norms = norm(f"blk.{i}.attn_norm.weight"), norm(f"blk.{i}.ffn_norm.weight")
        keep += [ws, norms]
        layers.append(DecodeLayer(norms[0].ctypes.data, norms[1].ctypes.data, *(w.c for w in ws.values()),
                                  kv.k[i].ctypes.data, kv.v[i].ctypes.data, None, None))
    table = (DecodeLayer * len(layers))(*layers)
    embed = QuickWeight(cache, "token_embd.weight")
    head = embed if cfg.tie_word_embeddings else QuickWeight(cache, "output.weight")
    if embed.cols != hidden or head.rows < cfg.vocab_size:
        return None
    inv_freq = inv_frequencies(cfg.rope_dim, cfg.rope_theta)
    blocks = np.arange(num_blocks, dtype=np.int64)
    i64, p = ctypes.c_int64, ctypes.c_void_p
    h = None
    for start in range(0, n, CHUNK):
        chunk = np.asarray(ids[start : start + CHUNK], dtype=np.int64)
        t = len(chunk)
        h = np.empty((t, hidden), dtype=np.uint16)
        if lib.qlookup_bf16(ctypes.byref(embed.c), p(chunk.ctypes.data), i64(t), p(h.ctypes.data)) != 0:
            return None
        positions = np.arange(start, start + t, dtype=np.int64)
        tables = np.ascontiguousarray(np.broadcast_to(blocks, (t, num_blocks)))
        lens = positions + 1
        rc = lib.decode_layers(table, i64(cfg.num_layers), p(h.ctypes.data), i64(t), i64(hidden), i64(cfg.num_heads),
                               i64(hkv), i64(d), i64(cfg.rope_dim), p(inv_freq.ctypes.data), p(positions.ctypes.data),
                               p(positions.ctypes.data), p(tables.ctypes.data), i64(num_blocks), p(lens.ctypes.data),
                               i64(num_blocks), i64(block), ctypes.c_float(cfg.norm_eps),
                               ctypes.c_float(d ** -0.5))
        if rc != 0:
            return None
    last = np.ascontiguousarray(h[-1:])
    normed = np.empty_like(last)
    final_norm = norm("output_norm.weight")
    lib.rms_norm_rows_bf16(p(last.ctypes.data), p(final_norm.ctypes.data), i64(1), i64(hidden),
                           ctypes.c_float(cfg.norm_eps), p(normed.ctypes.data))
    logits = np.empty((1, head.rows), dtype=np.uint16)
    if lib.qmatmul(p(normed.ctypes.data), ctypes.c_int(1), i64(1), ctypes.byref(head.c), p(logits.ctypes.data),
                   ctypes.c_int(1), i64(head.rows)) != 0:
        return None
    return bf16_to_f32(logits[0, : cfg.vocab_size])


def inv_frequencies(rope_dim: int, base: float) -> np.ndarray:
    """`layers.rotary.inv_frequencies` in NumPy: ``base^(-2i/d)``, float32 ``[rope_dim // 2]``.
    The power is taken in float64 and rounded: PyTorch's float32 power and NumPy's differ in the
    last bit of a few entries, this one in at most one of Qwen2.5's 64 (a test holds it to 1 ulp)."""
    exponent = np.arange(0, rope_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rope_dim)
    return np.float32(1.0) / np.power(np.float64(base), exponent.astype(np.float64)).astype(np.float32)


def filter_mask(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """`sample.sampler.filter_masks`'s rule in NumPy: which tokens survive top-k, then top-p, then
    min-p on temperature-scaled float32 logits ``[vocab]``; the most likely token always does."""
    order = np.argsort(-logits, kind="stable")
    s = logits[order]
    e = np.exp((s - s[0]).astype(np.float32))
    keep = np.ones(len(s), dtype=bool)
    if 0 < top_k < len(s):
        keep[top_k:] = False
    if top_p < 1.0:  # the mass before each token (exclusive, float64) below top_p of the top-k mass
        ed = np.where(keep, e.astype(np.float64), 0.0)
        before = np.concatenate([[0.0], np.cumsum(ed)[:-1]])
        keep &= before < np.float64(np.float32(top_p)) * ed.sum()
    if min_p > 0.0:
        keep &= e >= np.float32(min_p)
    keep[0] = True
    out = np.empty_like(keep)
    out[order] = keep
    return out


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp((x - x.max()).astype(np.float32))
    return (e / e.sum(dtype=np.float32)).astype(np.float32)


def sample(logits: np.ndarray, params) -> int:
    """The sampler's first token (`sample.sampler.Sampler` with no history): argmax for greedy
    params, else a draw from the softmax of ``logits / temperature`` over `filter_mask`."""
    if params.greedy:
        return int(np.argmax(logits))
    scaled = (logits / np.float32(params.temperature)).astype(np.float32)
    kept = filter_mask(scaled, params.top_k, params.top_p, params.min_p)
    probs = _softmax(np.where(kept, scaled, -np.inf)).astype(np.float64)
    rng = np.random.default_rng(params.seed)
    return int(rng.choice(len(probs), p=probs / probs.sum()))


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
    return FirstToken(ids, token, detok.emit(finished=True), finished, 0.0)


def continuation(first: FirstToken, params):
    """(prompt ids, `SamplingParams`) for the engine to go on after `first`: the prompt plus
    the token, and one token fewer to generate."""
    return first.prompt_ids + [first.token], dataclasses.replace(params, max_tokens=params.max_tokens - 1)
