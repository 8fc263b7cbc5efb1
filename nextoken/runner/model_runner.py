"""The model runner: turns a step's plan into one batched forward pass and returns logits.

For every scheduled sequence it lays out the new tokens flat (``input_ids``, ``positions``),
where their keys and values go (``slot_mapping``), and which blocks each sequence reads
(``block_tables``); decodes go first so attention can batch them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from nextoken.config import ModelConfig
from nextoken.distributed.sharding import parallelize, partition, shard_config
from nextoken.errors import EngineError, InvalidRequest
from nextoken.kernels import counting
from nextoken.layers.attention import AttentionMetadata
from nextoken.kv_cache.tensors import PagedKVCache, SlidingKVCache
from nextoken.layers.native_decode import NativeDecoder
from nextoken.loader.gguf import GGUFFile, read_model_config
from nextoken.errors import ModelLoadError
from nextoken.loader.hf import HFModelDir, read_hf_config
from nextoken.loader.host_memory import loading_allocations, release_free_memory
from nextoken.loader.weights import load_weights
from nextoken.models.registry import model_class
from nextoken.runner.device import CPU, Device, move_model, resolve_device
from nextoken.runner.huge_pages import arena_switched_off, place_weights, thp_mode
from nextoken.runner.inputs import HostBatch, Staging, layout, model_inputs
from nextoken.runner.plan import ExecutionPlan
from nextoken.sample.sampler import to_device

log = logging.getLogger("nextoken.runner")

@dataclass(slots=True)
class SequenceInput:
    """One sequence's part of a step: its new tokens, the position of the first, its blocks,
    and whether the logits of its last new token are wanted (to sample the next token).

    `as_decodes`: run the new tokens as that many single-token decodes (each attending to the
    keys up to its own position, all written in the same pass) and return the logits of every
    one of them: how speculative decoding verifies drafted tokens, with the very arithmetic of a
    plain decode step (so greedy output does not change with speculation).

    `fed_from` (async scheduling): the one new token is not on the host yet; it is row
    `fed_from` of the previous step's sampled tokens, which `ModelRunner.execute` takes as `fed`
    (``token_ids`` holds a placeholder).
    """

    token_ids: list[int]
    start: int
    block_ids: list[int]
    needs_logits: bool = True
    as_decodes: bool = False
    ring_ids: list[int] | None = None  # its sliding-window ring blocks (models with such layers)
    off_ring: dict[int, int] | None = None  # its logical blocks outside the ring's slots (`KVCacheManager.off_ring`)
    keep_hidden: bool = False  # keep the final hidden state of every new token (`ModelRunner.kept_hidden`)
    lora_id: int = 0  # its LoRA adapter (`ModelRunner.loras`), 0 for the base model
    prefill_len: int = 0  # tokens its whole prefill covers (the prompt), this chunk or not; 0: to this chunk's end
    fed_from: int = -1  # its one token is ``fed[fed_from]`` on the device (`ModelRunner.execute`); -1: token_ids

    @property
    def extent(self) -> int:
        """The tokens the sequence holds once its prefill (of which these tokens are part) is done."""
        return self.prefill_len or self.start + len(self.token_ids)

    def rows(self) -> list["SequenceInput"]:
        """The inputs this one runs as (itself, or one decode per token)."""
        if not self.as_decodes or len(self.token_ids) == 1:
            return [self]
        return [SequenceInput([t], self.start + i, self.block_ids, True, ring_ids=self.ring_ids, lora_id=self.lora_id)
                for i, t in enumerate(self.token_ids)]


class ModelRunner:
    """Owns the model weights, the execution plan and the KV cache tensors; runs batched
    forward passes.

    source: the opened model (`loader.source.open_model`: a GGUF file or a Hugging Face folder);
    dtype: weights and activations (float32 is the reference; bfloat16 the fast path);
    reference: plain float32 attention instead of the fast paths; keep_quantized: with
    bfloat16, block-quantized GGUF weights stay quantized (our kernel's codes, or PyTorch's int4)
    instead of being de-quantized; dense_weights: on PyTorch's int4 path, keep a bf16 copy as
    well; enforce_eager: PyTorch alone, none of our C kernels; prepared_cache: keep GGUF codes in
    the prepared-weights cache (`loader.prepared`); device: where the model runs
    (`runner.device.Device`: on a GPU the weights, the KV cache and every pass live in its
    memory); attention_backend, batch_invariant: `EngineArgs`'s; huge_pages: on the CPU, the linear
    weights move into one arena of 2 MiB pages after loading (`runner.huge_pages`). The `plan`
    (`runner.plan.ExecutionPlan`) is chosen from these here, once, and logged.

    tp: this process's place in a tensor-parallel group (`distributed.group.TensorParallel`), or
    None. With it the runner holds one rank's shard of the model and of the KV cache
    (`distributed.sharding`); rank 0's `init_kv_cache`, `execute` and `score_kept` first send
    themselves to the other ranks, which run the same calls in `follow`.
    Raises `ModelLoadError` when a tensor is missing or mis-shaped, `InvalidRequest` when the
    model cannot be split ``tp.size`` ways.
    """

    MIRRORED = ("init_kv_cache", "execute", "score_kept", "copy_blocks")  # what rank 0 sends to the followers

    def __init__(self, source: GGUFFile | HFModelDir, dtype: torch.dtype = torch.float32, reference: bool = False,
                 keep_quantized: bool = True, dense_weights: bool = False, enforce_eager: bool = False,
                 prepared_cache: bool = False, tp=None, quantization: str | None = None, device: Device = CPU,
                 attention_backend: str = "auto", huge_pages: bool = True, batch_invariant: bool = False):
        self.config: ModelConfig = read_config(source)
        self.dtype, self.tp, self.device = dtype, tp, device
        check_quantization(quantization, source, dtype)
        if device.is_cuda and tp is not None:
            raise InvalidRequest("tensor parallelism runs on the CPU (gloo); on a GPU run one process", "device")
        self.plan = ExecutionPlan.choose(dtype, enforce_eager, reference, keep_quantized, dense_weights, quantization,
                                         device, attention_backend, batch_invariant)
        t0 = time.perf_counter()
        loading_allocations(True)
        try:
            shards, model_config = None, self.config
            if tp is not None:
                part = partition(self.config, tp.rank, tp.size)
                model_config = shard_config(self.config, part)
            self.model = model_class(self.config.architecture)(model_config, dtype)
            if tp is not None:
                shards = parallelize(self.model, self.config, part, tp)
                prepared_cache = False  # the cache holds whole tensors
            load_weights(self.model, source, self.plan, prepared_cache, shards)
            arena = huge_pages and not arena_switched_off()
            self.weights_arena = place_weights(self.model) if arena and not device.is_cuda else None
        finally:
            loading_allocations(False)
        release_free_memory()
        if self.weights_arena is not None:
            self.plan.weights = self.weights_arena
        elif not arena and not device.is_cuda:
            self.plan.reasons["huge pages"] = "huge_pages=False" if not huge_pages else "NEXTOKEN_HUGE_PAGES=0"
        elif thp_mode() == "never" and not device.is_cuda:
            self.plan.reasons["huge pages"] = "transparent huge pages are never here"
        if device.is_cuda:
            move_model(self.model, device.torch)
            from nextoken.kernels.gpu.compiles import watch

            watch()  # (a Triton compilation after the warm-up logged with its cause)
        self.load_time = time.perf_counter() - t0
        self.plan.settle(self.model, tensor_parallel=tp is not None)
        self.native_decoder = NativeDecoder(self.model, self.plan.kernels.decode) if self.plan.native_decode else None
        self.loras = None  # the LoRA adapters (`lora.manager.LoRAManager`), made by `enable_lora`
        if log.isEnabledFor(logging.INFO):  # (describing reads /proc/self/smaps: `ExecutionPlan.weights`)
            log.info("%s: %s", self.config.name, self.plan.describe(self.model))
        self.kv: PagedKVCache | None = None
        self.kept_hidden: list[torch.Tensor] = []
        self.staging = Staging(device.torch)
        self.graphs = None  # the captured decode steps (`runner.cuda_graphs.DecodeGraphs`), a GPU's
        self.tilings = None  # Triton attention: its decode and prefill tiles (`kernels.gpu.attention.Tilings`)
        if self.plan.attention == "triton":
            from nextoken.kernels.gpu.attention import default_tilings

            self.tilings = default_tilings(self.config.num_queries_per_kv, self.config.head_dim, dtype == torch.float32)

    @classmethod
    def from_engine_args(cls, args, source: GGUFFile | HFModelDir, tp=None) -> ModelRunner:
        """The runner `args` (`EngineArgs`) describes for the opened model `source`."""
        from nextoken.loader.source import model_dtype

        device = resolve_device(args.device)
        runner = cls(source, model_dtype(source, args.dtype), reference=args.reference_attention,
                     dense_weights=args.dense_weights, enforce_eager=args.enforce_eager,
                     prepared_cache=args.prepared_cache, tp=tp, quantization=args.quantization, device=device,
                     attention_backend=args.attention_backend, huge_pages=args.huge_pages,
                     batch_invariant=args.batch_invariant)
        if args.enable_lora:
            runner.enable_lora(args.max_loras, args.max_lora_rank)
        return runner

    # -- tensor parallelism: rank 0 leads, the others follow ----------------------------------
    def _lead(self, method: str, *args) -> None:
        """On rank 0 of a tensor-parallel group: send this call to the followers first."""
        if self.tp is not None and self.tp.rank == 0:
            self.tp.send((method, args))

    def follow(self) -> None:
        """A follower rank: run each call rank 0 sends (`MIRRORED`) until it sends stop.
        Raises `TensorParallelError` when rank 0 or a collective fails."""
        while (call := self.tp.receive()) is not None:
            method, args = call
            if method not in self.MIRRORED:
                raise ValueError(f"rank 0 sent an unknown call {method!r}")
            getattr(self, method)(*args)

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight tensor held (dense, codes, packed int4, int8 tables), each counted once."""
        tensors = list(self.model.parameters())
        for m in self.model.modules():
            tensors += [t for part in (getattr(m, "int4", None) or []) for t in part]
            tensors += list(getattr(m, "q8", None) or [])
            qw = getattr(m, "qweight", None)
            tensors += [t for t in (qw.codes, qw.scales, qw.mins) if t is not None] if qw is not None else []
        return sum(t.nbytes for t in {t.data_ptr(): t for t in tensors}.values())

    @property
    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: `weight_bytes` less the embedding table but one
        row of it (a step looks up one row per sequence), unless the LM head reads that same table
        (tied), which then counts once, as the head."""
        emb, head = self.model.embed_tokens, self.model.lm_head
        tied = (emb.weight is not None and emb.weight is getattr(head, "weight", None)) or \
            (emb.qweight is not None and emb.qweight is getattr(head, "qweight", None))
        if tied:
            return self.weight_bytes
        return self.weight_bytes - emb.nbytes + emb.nbytes // emb.vocab_size

    def init_kv_cache(self, num_blocks: int, block_size: int, sliding_blocks: int = 0,
                      ring_blocks: int = 0, cache_dtype: str = "auto") -> PagedKVCache:
        """The paged cache for `num_blocks` blocks (stored as `cache_dtype`: ``auto`` or
        ``int8``), and for a model with sliding-window layers their rings: `sliding_blocks`
        blocks, `ring_blocks` per sequence. Under tensor parallelism, each rank's cache holds its
        key/value heads."""
        self._lead("init_kv_cache", num_blocks, block_size, sliding_blocks, ring_blocks, cache_dtype)
        cfg = self.model.config  # this rank's heads
        sliding = None
        if self.config.sliding_layers:
            if not sliding_blocks:
                raise ValueError("a model with sliding-window layers needs sliding_blocks and ring_blocks")
            sliding = SlidingKVCache(cfg, sliding_blocks, block_size, ring_blocks, self.dtype, self.device.torch,
                                     spare=self.plan.cuda_graphs)
        self.kv = PagedKVCache(cfg, num_blocks, block_size, self.dtype, sliding, cache_dtype, self.device.torch,
                               spare=self.plan.cuda_graphs)
        self.plan.settle_cache(self.kv.quantized)
        self.attention_kernels = self.plan.attention_kernels
        if self.tilings is not None:
            self.tilings = self.plan.choose_tilings(cfg, block_size, self.tilings)
        return self.kv

    def copy_blocks(self, copies: list[tuple[int, int]], sliding: list[tuple[int, int]] = ()) -> None:
        """Copy whole blocks of the paged cache and of the sliding-window rings' pool, (source,
        destination) block ids in order (`PagedKVCache.copy_blocks`); on every tensor-parallel rank."""
        self._lead("copy_blocks", copies, sliding)
        self.kv.copy_blocks(copies, sliding)

    def prepare(self, seqs: list[SequenceInput]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Batch inputs for `seqs`: input_ids ``[T]``, positions ``[T]``, the attention
        metadata (on the model's device), and the batch order (indices into `seqs`, decodes
        first)."""
        batch = layout(seqs, self.kv.block_size, self.kv.sliding)
        return (*self._model_inputs(batch), batch.order)

    def _model_inputs(self, batch: HostBatch,
                      fed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        splits = 1
        if self.plan.attention == "triton" and batch.num_decodes:
            splits = self._decode_splits(batch.num_decodes)
        return model_inputs(batch, self.staging, self.plan.attention, self.attention_kernels, self.tilings,
                            splits, self.plan.batch_invariant, fed)

    def _decode_splits(self, num_decodes: int) -> int:
        """Key splits per decode of the Triton attention for a step of `num_decodes` decodes
        (`kernels.gpu.attention.decode_splits`; on the CPU, as for a GPU of one multiprocessor); one
        in a batch-invariant plan (the split of a decode's keys would follow the batch's size)."""
        from nextoken.kernels.gpu.attention import decode_splits

        if self.plan.batch_invariant:
            return 1
        return decode_splits(num_decodes, self.model.config.num_kv_heads, max(1, self.device.num_sms))

    SAMPLER_BYTES = 48  # per logits element: the sampler's float32, float64 and index temporaries at their peak

    def gpu_kv_memory(self, utilization: float, max_tokens: int, max_seqs: int, ring_blocks: int = 0) -> int:
        """Bytes the KV cache may take on this GPU (vLLM's ``--gpu-memory-utilization``):
        `utilization` of its memory, less what is in use now (the weights, the CUDA context,
        other processes) and less the peak that one forward pass of `max_tokens` tokens, the
        logits of `max_seqs` rows and their sampling take beyond it: the pass is measured over a
        temporary cache (with `ring_blocks` ring blocks for a sliding-window model), the sampler
        estimated at `SAMPLER_BYTES` per logits element. Raises `ModelLoadError` when nothing is
        left."""
        dev, cfg = self.device.torch, self.config
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        bs = 16
        blocks = -(-max_tokens // bs)
        self.init_kv_cache(blocks, bs, ring_blocks, ring_blocks)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        seq = SequenceInput([0] * max_tokens, 0, list(range(blocks)), ring_ids=list(range(ring_blocks)) or None)
        self.execute([seq])
        with torch.inference_mode():
            self.model.compute_logits(torch.zeros(max_seqs, cfg.hidden_size, dtype=self.dtype, device=dev))
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base + max_seqs * cfg.vocab_size * self.SAMPLER_BYTES
        self.kv = None
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        budget = int(total * utilization) - (total - free) - peak
        log.info("GPU memory: %.2f GiB of %.2f in use (weights %.2f GiB), a pass's peak %.2f GiB, so %.2f GiB for "
                 "the KV cache at --gpu-memory-utilization %.2f", (total - free) / 2**30, total / 2**30,
                 self.weight_bytes / 2**30, peak / 2**30, budget / 2**30, utilization)
        if budget <= 0:
            raise ModelLoadError(f"{self.device.name}: the weights ({self.weight_bytes / 2**30:.2f} GiB) and a pass's "
                                 f"peak ({peak / 2**30:.2f} GiB) leave no room for the KV cache within "
                                 f"--gpu-memory-utilization {utilization} of {total / 2**30:.1f} GiB "
                                 f"({(total - free) / 2**30:.2f} GiB in use); raise it or lower "
                                 "--max-num-batched-tokens")
        return budget

    def capture_decode_graphs(self, max_batch: int, max_model_len: int) -> None:
        """Capture the decode step as CUDA graphs for batches of up to `max_batch` decodes of up to
        `max_model_len` tokens (`runner.cuda_graphs`); on the CPU (a test's plan) the same padded
        static buffers run eagerly. Needs the KV cache, made with its spare block."""
        from nextoken.runner.cuda_graphs import DecodeGraphs

        max_blocks = -(-max_model_len // self.kv.block_size) + 1
        with torch.inference_mode():
            self.graphs = DecodeGraphs(self, max_batch, max_blocks, self._decode_splits, self.device.is_cuda)

    @torch.inference_mode()
    def execute(self, seqs: list[SequenceInput], tracer=None, all_logits: bool = False,
                fed: torch.Tensor | None = None) -> torch.Tensor:
        """Run one forward pass over `seqs`. Returns float32 logits ``[num_wanted, vocab]`` for
        the last new token of each sequence with `needs_logits`, in the order of `seqs` (with
        `all_logits`: ``[num_tokens, vocab]`` for every new token, in batch order). An input
        with `as_decodes` contributes one row per new token. The final hidden states of the new
        tokens of each input with `keep_hidden` are left in `kept_hidden` (``[n, hidden]`` each,
        in the order of those inputs), for `score_kept`. `fed`: int64 ``[n]`` on the device, the
        previous step's sampled tokens, from which each input with `fed_from` takes its token
        (async scheduling: the host has not read them yet). Raises `EngineError` for a `tracer`
        or `fed` under tensor parallelism, `TensorParallelError` when a collective fails."""
        if (tracer is not None or fed is not None) and self.tp is not None:
            raise EngineError("tracing a request and async scheduling are not available with tensor parallelism")
        with counting(self.plan.kernels.fallbacks):  # this engine's kernel fallbacks
            return self._execute(seqs, tracer, all_logits, fed)

    def _execute(self, seqs: list[SequenceInput], tracer, all_logits: bool, fed: torch.Tensor | None) -> torch.Tensor:
        self._lead("execute", seqs, None, all_logits)
        seqs = [row for s in seqs for row in s.rows()]
        self.kept_hidden = []
        one_call = [self._one_call(s, tracer) for s in seqs]
        if all_logits or all(one_call) or not any(one_call):  # one pass
            hidden, last = self._forward(seqs, tracer, all(one_call), fed)
            if all_logits:
                return self.model.compute_logits(hidden)
        else:  # the rows the C step takes, then the rest on the PyTorch layers
            parts = [[i for i, c in enumerate(one_call) if c == want] for want in (True, False)]
            hidden, last, at = [], {}, 0
            for part, want in zip(parts, (True, False)):
                h, part_last = self._forward([seqs[i] for i in part], tracer, want, fed)
                last.update({part[j]: at + row for j, row in part_last.items()})
                hidden.append(h)
                at += h.shape[0]
            hidden = torch.cat(hidden)
        if any(s.keep_hidden for s in seqs):
            self.kept_hidden = [hidden[last[i] + 1 - len(s.token_ids) : last[i] + 1]
                                for i, s in enumerate(seqs) if s.keep_hidden]
        rows = [last[i] for i, s in enumerate(seqs) if s.needs_logits]
        run = bool(rows) and rows == list(range(rows[0], rows[0] + len(rows)))  # (a decode batch: a slice, no copy)
        if run and len(rows) == hidden.shape[0]:  # (every row: not even a slice)
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[rows[0] : rows[0] + len(rows)] if run
                                         else hidden[to_device(rows, torch.long, hidden.device)])

    def _one_call(self, s: SequenceInput, tracer) -> bool:
        """Whether `s`'s rows go to the one-call C step (`NativeDecoder.takes`)."""
        return (self.native_decoder is not None and tracer is None and self.plan.attention != "reference"
                and NativeDecoder.takes(len(s.token_ids), s.extent, self._ring_tokens))

    @property
    def _ring_tokens(self) -> int | None:
        """Tokens a sequence's sliding-window ring holds (None: no such layers)."""
        sliding = self.kv.sliding
        return sliding.ring_blocks * sliding.block_size if sliding is not None else None

    def _forward(self, seqs: list[SequenceInput], tracer, one_call: bool,
                 fed: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[int, int]]:
        """One forward pass over `seqs` (in the C step with `one_call`, unless the kernel
        refuses): the final hidden states ``[T, hidden]`` in batch order, and each sequence's
        last row in them (by index into `seqs`); `fed`: `execute`'s."""
        batch = layout(seqs, self.kv.block_size, self.kv.sliding, fed is not None)
        last = {i: batch.query_start_loc[row + 1] - 1 for row, i in enumerate(batch.order)}
        plain = tracer is None and not any(s.lora_id for s in seqs)  # (a graph holds no tracer or adapter)
        if self.graphs is not None and plain and self.graphs.takes(batch):
            return self.graphs.run(batch, fed), last
        input_ids, positions, meta = self._model_inputs(batch, fed)
        order = batch.order
        adapters = self._set_lora_batch(seqs, order, meta.query_start_loc) if self.loras is not None else False
        if tracer is not None and getattr(tracer, "wants_probs", True):
            meta.probs = []  # the sink each layer's reference attention fills (`AttentionMetadata.probs`)
        hidden = None
        if one_call:  # every layer of the step and the final norm in one C call
            hidden = self.native_decoder(self.model.embed(input_ids, positions), positions, self.kv, meta,
                                         self.loras.batch if adapters else None)
        if hidden is None:
            hidden = self.model(input_ids, positions, self.kv, meta, tracer)
        return hidden, last

    def enable_lora(self, max_loras: int, max_lora_rank: int) -> None:
        """Let requests use LoRA adapters (`lora.manager.LoRAManager`, at ``self.loras``). Raises
        `InvalidRequest` under a batch-invariant plan (the adapters' products run on PyTorch's
        batched matmuls)."""
        from nextoken.lora.manager import LoRAManager

        if self.plan.batch_invariant:
            raise InvalidRequest("--batch-invariant does not cover LoRA adapters (their products run on PyTorch's "
                                 "batched matmuls): drop --enable-lora or --batch-invariant", "batch_invariant")

        self.loras = LoRAManager(self.model, max_loras, max_lora_rank, self.device.torch)

    def _set_lora_batch(self, seqs: list[SequenceInput], order: list[int], qsl: list[int]) -> bool:
        """Tell the adapters which rows of this pass are theirs; whether any row has one."""
        adapter_of_row = [0] * qsl[-1]
        for row, i in enumerate(order):
            adapter_of_row[qsl[row] : qsl[row + 1]] = [seqs[i].lora_id] * (qsl[row + 1] - qsl[row])
        self.loras.set_batch(adapter_of_row)
        return bool(self.loras.batch.ids)

    @torch.inference_mode()
    def score_kept(self, index: int, n: int, targets: list[int], top: int) -> list[dict[int, float]]:
        """`score` of the first `n` rows of ``kept_hidden[index]`` (the last `execute`)."""
        self._lead("score_kept", index, n, targets, top)
        return score(self.model, self.kept_hidden[index][:n], targets, top)


def score(model, hidden: torch.Tensor, targets: list[int], top: int, chunk: int = 128) -> list[dict[int, float]]:
    """Log-probabilities from final hidden states ``[n, hidden]``: for each row, ``{target:
    logprob, **top alternatives}`` under log-softmax of the row's logits (float32). Rows go
    through the head `chunk` at a time, so a long prompt never holds ``n x vocab`` logits."""
    out = []
    for a in range(0, hidden.shape[0], chunk):
        lp = model.compute_logits(hidden[a : a + chunk]).float().log_softmax(-1)
        tgt = torch.tensor(targets[a : a + chunk], device=lp.device)
        chosen = lp.gather(1, tgt[:, None])[:, 0].tolist()
        tops = lp.topk(top, dim=-1) if top else None
        for j, t in enumerate(targets[a : a + chunk]):
            entry = {t: chosen[j]}  # the prompt's token first, as with sampled tokens
            if top:
                entry.update(zip(tops.indices[j].tolist(), tops.values[j].tolist()))
            out.append(entry)
    return out


def check_quantization(quantization: str | None, source, dtype: torch.dtype) -> None:
    """``--quantization`` needs a Hugging Face folder (a GGUF file's tensors are already in their
    formats) and bf16 (float32 is the exact reference); `ModelLoadError` says which is wrong."""
    if quantization is None:
        return
    if not isinstance(source, HFModelDir):
        raise ModelLoadError(f"--quantization {quantization} quantizes a Hugging Face folder's weights at load; "
                             f"{source.path} is a GGUF file, whose tensors keep the formats they were written in")
    if dtype != torch.bfloat16:
        raise ModelLoadError(f"--quantization {quantization} runs in bfloat16; --dtype "
                             f"{str(dtype).removeprefix('torch.')} is the unquantized reference")


def read_config(source: GGUFFile | HFModelDir) -> ModelConfig:
    """The `ModelConfig` of an opened model (GGUF metadata or a folder's config.json)."""
    return read_model_config(source) if isinstance(source, GGUFFile) else read_hf_config(source)
