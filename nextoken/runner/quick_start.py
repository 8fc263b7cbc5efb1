"""The answer of ``nextoken run`` before PyTorch is imported (the quick start).

Importing PyTorch takes longer on a small CPU than a small model's whole answer. For a model
whose weights are already in the prepared-weights cache (`loader.prepared`), everything an
answer needs is torch-free: the GGUF metadata, config and tokenizer (`loader.gguf`,
`tokenizer`), the prepared file mapped with NumPy (`loader.prepared.PreparedFile`: the codes,
the norms and biases, RoPE's frequencies, as the engine's model holds them) and our C kernels.
`first_tokens` runs the prompt through the engine's one-call decode step (`kernels.decode_step`,
the module `layers.native_decode` calls too), in calls of at most `decode_step.ROWS_PER_CALL`
tokens: within a call each row is one prompt position, at ``slot = position``, attending to
``position + 1`` keys, the keys and values of a call being written before any row attends, so
the call is a causal prefill. Then the final norm, the LM head and the sampler's draw
(`sample.draw`: the same kernel, one uniform number a token from the request's seeded stream,
`sample.rng`), as the engine would; then each further token through the same call as one row
(the engine's decode step), until the answer ends (an end-of-generation token, `max_tokens`),
its text streamed as the engine's detokenizer releases it (`_Answer`).

The engine prefills a prompt this short with the same call (`NativeDecoder.takes`) and decodes
with it, so the logits are the engine's bit for bit and ``nextoken run --seed S`` prints the text
`LLM.generate` gives for seed S, in a third to a half of the time for a short answer (PyTorch is
never imported). Where only the first token may be drawn here (a bound on the KV cache's size, the
disk tier: the engine's to keep, `_goes_on`), or a step fails, the engine is built as usual
(`LLM.from_engine_args(args, first=...)`: the GGUF file and tokenizer read here are reused) and
runs the request as `LLM.generate` would, with those tokens chosen already (`LLM.stream(...,
first=...)`: its prefill, then each token emitted without a draw, the seeded stream past the
numbers they used).

It runs only where it is the engine's arithmetic: GGUF weights all cached as codes, layers
``decode.c`` implements (`decode_step.serves`), bf16 with a bf16 KV cache, one sequence, a prompt
of at most `MAX_PROMPT_TOKENS`, and sampling settings whose tokens need no history (no
penalties, bias, minimum length, logprobs, grammar or watermark; stop strings and tokens end
the answer as the engine's output processing does): each field of
`SamplingParams` and `EngineArgs` says with which values it keeps the first token (its
``quick_start`` mark, `keeps_first_token`), and each marked field is one a later token does not
depend on either; an unmarked field must have its default. Anything else, and any failure here,
returns None: the command then runs the engine alone, which reports errors.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import logging
import os
from dataclasses import dataclass

import numpy as np

from nextoken.kernels.decode_step import MAX_PREFILL_TOKENS, ROWS_PER_CALL, decode_layers
from nextoken.loader.opened import OpenedModel
from nextoken.sample.draw import draw_one

log = logging.getLogger(__name__)

# longer prompts go to the engine: it prefills them with its PyTorch layers, whose arithmetic
# (attention) differs from the decode step's by bf16 rounding; up to this bound its prefill is
# this same call (`layers.native_decode.NativeDecoder.takes`)
MAX_PROMPT_TOKENS = MAX_PREFILL_TOKENS


def max_prompt_tokens(cfg, block_size: int) -> int:
    """The longest prompt the engine prefills with the decode step (`NativeDecoder.takes`):
    `MAX_PROMPT_TOKENS`, and for a model with sliding-window layers at most a sequence's ring
    (`kv_cache.manager.ring_blocks`, its least: one decode row a step)."""
    if not cfg.sliding_layers:
        return MAX_PROMPT_TOKENS
    from nextoken.kv_cache.manager import ring_blocks

    return min(MAX_PROMPT_TOKENS, ring_blocks(cfg.sliding_window, block_size) * block_size)


@dataclass
class FirstTokens:
    """What `first_tokens` computed: the prompt's ids, the tokens drawn, their text as streamed
    (what the engine's detokenizer would stream for them), whether the sequence ends with the
    last, the seconds it took, how many uniform numbers the draws took from the seeded stream (0
    greedy, else one a token) and the GGUF file and tokenizer read (`opened`), which the engine
    takes over when the answer goes on (`LLM.from_engine_args(args, first=...)`)."""

    prompt_ids: list[int]
    tokens: list[int]
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


def first_tokens(prompt: str, engine_args, params, chat: bool, system: str | None = None, emit=None,
                 most: int | None = None) -> FirstTokens | None:
    """The first tokens for `prompt` as ``nextoken run`` would draw them, without PyTorch: the
    whole answer, or (`most`) at most that many tokens; None when this path does not apply (see
    the module docstring). `chat`: apply the chat template when the model has one; `emit(text)`:
    called with each piece of text as the detokenizer releases it (the command prints it)."""
    import time

    from nextoken.errors import ModelLoadError
    from nextoken.kernels import native_allowed

    t0 = time.perf_counter()
    shown: list[str] = []
    show = emit or (lambda text: None)
    try:
        if not (keeps_first_token(params) and _engine_allows(engine_args) and native_allowed()):
            return None
        path = model_file(engine_args.model)
        if path is None:
            return None
        if not _goes_on(engine_args):
            most = 1
        out = _run(path, prompt, engine_args, params, chat, system, lambda text: shown.append(text) or show(text),
                   most)
    except ModelLoadError:  # a damaged GGUF file: the engine's reader (the same) would say the same, later
        raise
    except Exception as exc:  # never worse than the engine: it runs next and reports what is wrong
        if shown:  # text is out (a closed pipe while printing it): the command's error, not a reason to start over
            raise
        log.info("quick start skipped (%s: %s)", type(exc).__name__, exc)
        return None
    if out is not None:
        out.seconds = time.perf_counter() - t0
        n = len(out.tokens)
        log.info("quick start: %d token%s in %.3f s, before PyTorch was imported%s", n, "" if n == 1 else "s",
                 out.seconds, "" if out.finished else "; the engine goes on")
    return out


def _goes_on(engine_args) -> bool:
    """Whether this path may draw past the first token: no bound on the KV cache's size (the
    engine would refuse an answer it cannot hold) and no disk tier (the engine would write the
    answer's blocks there). Otherwise it draws the first token alone and the engine goes on."""
    e = engine_args
    return e.kv_cache_memory is None and not e.num_kv_blocks and e.kv_cache_dir is None and e.kv_cache_disk is None


def _run(path, prompt, engine_args, params, chat, system, emit, most) -> FirstTokens | None:
    from nextoken.kernels import load
    from nextoken.kernels.decode_step import QUICK_ARCHITECTURES, serves
    from nextoken.loader.gguf import GGUFFile, read_model_config
    from nextoken.loader.prepared import merges_path
    from nextoken.sample.rng import DrawGenerator
    from nextoken.tokenizer import Tokenizer
    from nextoken.tokenizer.chat_template import chat_prompt

    f = GGUFFile(path)  # the header and tokenizer first: the file's hash (the cache's key) is
    cfg = read_model_config(f)  # being computed on another thread meanwhile (`loader.prepared`)
    if not serves(cfg) or cfg.architecture not in QUICK_ARCHITECTURES or cfg.extra.get("final_logit_softcapping"):
        return None
    tok = Tokenizer.from_gguf(f, merges_path(path))  # (the prepared cache is this path's condition)
    if chat and tok.chat_template is not None:
        prompt = chat_prompt(tok, prompt, system)
    ids = tok.encode(prompt)
    ctx = min(cfg.context_length, engine_args.max_model_len or cfg.context_length)
    if not ids or len(ids) + params.max_tokens > ctx or any(not 0 <= t < cfg.vocab_size for t in ids):
        return None  # the engine says what is wrong, or truncates (truncate_prompt)
    if len(ids) > max_prompt_tokens(cfg, engine_args.block_size):
        return None
    params = params.validate(cfg.vocab_size, engine_args.max_logprobs)
    sampling = load("sampling")
    if not prepared_path(path).is_file() or sampling is None:
        return None  # the first load packs the codes and writes the cache
    _set_threads(engine_args.num_threads)
    most = params.max_tokens if most is None else min(most, params.max_tokens)
    forward = Forward(f, cfg, PromptKV(cfg, len(ids) + most, engine_args.block_size))
    logits = forward.logits(ids, 0)
    if logits is None:
        return None
    out = FirstTokens(ids, [], "", False, opened=OpenedModel(f, tok))
    answer = _Answer(tok, params, DrawGenerator(params.seed), sampling)
    while logits is not None:
        try:  # past the first token a failing step hands the answer so far to the engine
            token, text, finished = answer.next(logits)
        except Exception as exc:  # noqa: BLE001
            if not out.tokens:
                raise
            log.info("quick start: stopped after %d tokens (%s: %s)", len(out.tokens), type(exc).__name__, exc)
            break
        out.tokens.append(token)
        out.draws, out.finished = answer.draws, finished
        if text:
            out.text += text
            emit(text)
        if finished or len(out.tokens) >= most:
            break
        try:
            logits = forward.logits([token], len(ids) + len(out.tokens) - 1)
        except Exception as exc:  # noqa: BLE001
            log.info("quick start: stopped after %d tokens (%s: %s)", len(out.tokens), type(exc).__name__, exc)
            logits = None
    if not out.text and not out.finished:
        return None  # nothing shown yet (the first token's text waits for more bytes): the engine does it all
    return out


class _Answer:
    """The draws and the streamed text of one answer, as the engine's sampler and output
    processing give them (`engine.output_processor.process_token`): one uniform number a sampled
    token from the request's stream, the end at an end-of-generation token (its text not added),
    a stop token, a stop string or `max_tokens`, and the detokenizer's pieces
    (`IncrementalDetokenizer`, which holds back what could begin a stop string)."""

    def __init__(self, tok, params, generator, sampling):
        from nextoken.tokenizer.detokenizer import IncrementalDetokenizer

        self.tok, self.params, self.generator, self.sampling = tok, params, generator, sampling
        self.detok = IncrementalDetokenizer(tok, params.skip_special_tokens, params.stop,
                                            params.include_stop_str_in_output)
        self.count = self.draws = 0

    def next(self, logits: np.ndarray) -> tuple[int, str, bool]:
        """The token drawn from `logits` (float32 ``[vocab]``), the text it releases, and whether
        the answer ends with it."""
        greedy = self.params.greedy
        token = draw_one(self.sampling, logits, self.params, 0.0 if greedy else self.generator.uniform())
        self.draws += 0 if greedy else 1
        self.count += 1
        p = self.params
        finished = (token in self.tok.eog_token_ids and not p.ignore_eos) or token in p.stop_token_ids \
            or self.detok.add_token(token) or self.count >= p.max_tokens
        if finished:
            self.detok.flush()
        return token, self.detok.emit(finished), finished


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
        b = _f32(b) if self.file.dtype(name) == "BF16" else b.astype(np.float32)
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


class Forward:
    """The model's pass over new tokens, from the GGUF file `f` (`loader.gguf.GGUFFile`, config
    `cfg`) and its prepared-weights cache, by our C kernels alone: `logits(ids, start)` runs
    `ids` at positions ``start`` on, writing their keys and values to `kv`, and returns the last
    one's logits. Gemma 3's layers read their norms, QK-norms and post-norms, and its
    sliding-window layers read `kv` as a ring that never wraps (logical block b in block b, each
    row's window from ``position - window + 1``): the keys the engine's ring holds for them.
    Raises OSError, ValueError or KeyError for a cache that is missing, stale or lacks a tensor."""

    def __init__(self, f, cfg, kv: PromptKV):
        from nextoken.kernels import load
        from nextoken.kernels.decode_step import DecodeArch, layer_table
        from nextoken.loader.gguf_names import GGUF_EMBEDDING, GGUF_OUTPUT, GGUF_OUTPUT_NORM, GGUF_PROJECTIONS, \
            layer_projection
        from nextoken.loader.prepared import PREPARED_INV_FREQ, PREPARED_INV_FREQ_LOCAL, PreparedFile, file_key

        self.lib, self.cfg, self.kv = load("decode"), cfg, kv
        if self.lib is None:
            return
        w = _Weights(PreparedFile(str(prepared_path(f.path)), file_key(f.path)))
        self.gemma, sliding = cfg.architecture == "gemma3", set(cfg.sliding_layers)
        layers = []
        for i in range(cfg.num_layers):
            projections = []
            for g in GGUF_PROJECTIONS:
                bias = None
                if cfg.attention_bias and g in ("attn_q", "attn_k", "attn_v"):
                    bias = w.bias(layer_projection(i, g, "bias"))
                projections.append(w.codes(layer_projection(i, g), bias))
            norm = lambda name: w.dense(f"blk.{i}.{name}.weight").ctypes.data  # noqa: E731
            qk = post = (None, None)
            if cfg.architecture in ("qwen3", "gemma3"):  # an RMSNorm over each query and key head
                qk = norm("attn_q_norm"), norm("attn_k_norm")
            if self.gemma:  # its norms of the attention's and the feed-forward's outputs
                post = norm("post_attention_norm"), norm("post_ffw_norm")
            layers.append((norm("attn_norm"), norm("ffn_norm"), projections, kv.k[i].ctypes.data, kv.v[i].ctypes.data,
                           None, None, *qk, *post, int(i in sliding)))
        self.table = layer_table(layers)
        self.embed = w.codes(GGUF_EMBEDDING)
        self.head = self.embed if cfg.tie_word_embeddings else w.codes(GGUF_OUTPUT)
        self.inv_freq, self.final_norm, self.weights = w.dense(PREPARED_INV_FREQ), w.dense(GGUF_OUTPUT_NORM), w
        self.blocks = np.arange(kv.k.shape[2], dtype=np.int64)  # the cache's blocks in order: every row's table
        self.arch = None
        if self.gemma or sliding:
            self.arch = DecodeArch(gemma=int(self.gemma), ring_max_blocks=kv.k.shape[2], ring_NB=kv.k.shape[2])
            if self.gemma:
                self.arch.inv_freq_local = w.dense(PREPARED_INV_FREQ_LOCAL).ctypes.data
        # Gemma's embeddings times sqrt(hidden), that factor rounded to bf16 as the model holds it
        self.embed_scale = _bf16_bits(np.float32(cfg.hidden_size ** 0.5)) if self.gemma else None

    def logits(self, ids: list[int], start: int) -> np.ndarray | None:
        """float32 logits ``[vocab]`` of the token after `ids` (at positions ``start`` on, after
        the ``start`` tokens already run), or None when the decode kernel is unavailable or
        refuses a shape. Calls of at most `ROWS_PER_CALL` rows, each row attending to its
        position's keys."""
        lib, cfg, kv = self.lib, self.cfg, self.kv
        if lib is None or self.embed.K != cfg.hidden_size or self.head.N < cfg.vocab_size:
            return None
        hidden, num_blocks, block, blocks = cfg.hidden_size, kv.k.shape[2], kv.block_size, self.blocks
        i64, p = ctypes.c_int64, ctypes.c_void_p
        h = None
        for first in range(0, len(ids), ROWS_PER_CALL):
            chunk = np.asarray(ids[first : first + ROWS_PER_CALL], dtype=np.int64)
            t = len(chunk)
            h = np.empty((t, hidden), dtype=np.uint16)
            if lib.qlookup_bf16(ctypes.byref(self.embed), p(chunk.ctypes.data), i64(t), p(h.ctypes.data)) != 0:
                return None
            if self.embed_scale is not None:  # a bf16 product, rounded once (exact in float32)
                h = _bf16_bits(_f32(h) * _f32(self.embed_scale))
            positions = np.arange(start + first, start + first + t, dtype=np.int64)
            tables = np.ascontiguousarray(np.broadcast_to(blocks, (t, num_blocks)))
            if self.arch is not None and cfg.sliding_layers:  # the rings: slot = position, as for the full layers
                self.arch.ring_tables, self.arch.ring_slots = tables.ctypes.data, positions.ctypes.data
                self.arch.window = cfg.sliding_window
            if decode_layers(lib, self.table, cfg, h.ctypes.data, t, self.inv_freq.ctypes.data, positions.ctypes.data,
                             positions.ctypes.data, tables.ctypes.data, num_blocks, num_blocks, block,
                             cfg.attention_scale, self.arch, final_norm=self.final_norm.ctypes.data) != 0:
                return None
        normed = np.ascontiguousarray(h[-1:])  # (after the final norm, which the call applied)
        logits = np.empty((1, self.head.N), dtype=np.uint16)
        if lib.qmatmul(p(normed.ctypes.data), ctypes.c_int(1), i64(1), ctypes.byref(self.head),
                       p(logits.ctypes.data), ctypes.c_int(1), i64(self.head.N)) != 0:
            return None
        return _f32(logits[0, : cfg.vocab_size])  # bf16 -> float32, exact


def _f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) -> float32 values, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _bf16_bits(x) -> np.ndarray:
    """float32 -> bf16 bits (uint16), rounded to nearest, ties to even (as PyTorch's cast;
    finite values)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32)
    return ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)


def prompt_logits(f, cfg, ids: list[int], kv: PromptKV | None = None) -> np.ndarray | None:
    """float32 logits ``[vocab]`` of the token after the prompt `ids` (`Forward`), writing the
    prompt's keys and values to `kv` (a fresh `PromptKV` of 16-token blocks when None)."""
    return Forward(f, cfg, kv or PromptKV(cfg, len(ids), 16)).logits(ids, 0)
