"""All decoder layers of a decode step in one call to our C kernel (``kernels/decode.c``).

A decode step of a small model is mostly overhead: ~12 PyTorch ops per layer, each a few
microseconds of dispatch, around matmuls that take tens. `NativeDecoder` hands the whole layer
stack to C for single-token decodes (speculative verification's rows among them) and for the
prefill of short prompts (`NativeDecoder.takes`): RMSNorm, the q/k/v projections
(one int8 quantization of the input for the three), RoPE, the KV cache write, paged
attention (bf16 or int8 cache), the output projection, the SwiGLU feed-forward and both residuals, with the same
bf16 roundings as the PyTorch layers (`models.llama.LlamaDecoderLayer`), which stay the path
for longer prefills, tracing, the reference attention and ``--enforce-eager``; a test compares
the two.
Qwen 3's QK-norm and Gemma 3's layer (its float32-product norms, post-norms, GeGLU, and
sliding-window layers reading their rings with their own RoPE base) run there too.
The model runner decides at load whether it runs (`nextoken.runner.plan`).
"""

from __future__ import annotations

import ctypes

import torch

from nextoken.kernels import count_fallback
from nextoken.kernels.decode_step import MAX_PREFILL_TOKENS, ROWS_PER_CALL, DecodeArch, LoRAStep, LoRAWeights, \
    decode_layers, layer_table, serves
from nextoken.layers.activation import gelu_tanh_and_mul, silu_and_mul


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


class NativeDecoder:
    """The C decode path for a model whose layers `decode_step.serves` and whose projections all
    run on our kernel (`Linear.on_kernel`: `QuantWeight` codes or dense bf16); `lib`: the
    ``decode`` library the execution plan resolved."""

    def __init__(self, model, lib):
        self.model = model
        self.lib = lib
        self._table = None
        self._kv = None
        self._inv_freq = None  # RoPE's frequencies as float32, for the table's life
        self._scale = None  # the attention's scale
        self._inv_freq_local = None  # the sliding-window layers' RoPE frequencies (Gemma 3), float32
        self._final_norm = None  # the final norm's weight (address), when the call applies it
        self._lora = (None, None)  # (the LoRA batch's key, its `LoRAWeights` table and the stacks it points at)

    @staticmethod
    def supports(model) -> bool:
        """bf16, layers decode.c implements (`decode_step.serves`) and every projection on our
        kernel. (Whether the kernel builds is the plan's check.)"""
        return NativeDecoder.why_not(model) is None

    @staticmethod
    def why_not(model) -> str | None:
        """Why `supports` says no, in words for the plan's log line; None when it says yes."""
        if model.dtype != torch.bfloat16:
            return f"{str(model.dtype).removeprefix('torch.')} weights"
        if not serves(model.config):
            return f"not for this architecture ({model.config.architecture}) or its head shapes"
        gemma = model.config.architecture == "gemma3"
        for layer in model.layers:
            a, m = layer.self_attn, layer.mlp
            if m.act is not (gelu_tanh_and_mul if gemma else silu_and_mul):
                return f"an activation decode.c does not run ({m.act.__name__})"
            for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
                if not lin.on_kernel:
                    return f"a projection on {lin.method.name}, not our kernel"
        return None

    @staticmethod
    def takes(new_tokens: int, prefill_len: int, ring_tokens: int | None = None) -> bool:
        """Whether a sequence's `new_tokens` of a step run here: a decode (one token), or rows of a
        prefill whose whole extent (`prefill_len` tokens: the prompt, whatever the chunk or the
        prefix cache leaves of it) is at most `MAX_PREFILL_TOKENS` and, on a model with
        sliding-window layers, at most their ring's `ring_tokens` (a sequence's ring blocks times
        the block size: no prefill row then overwrites a slot that another row of it still
        reads). Each row writes its key and value, then attends to every key up to its position
        (in its window), so prefill rows are causal here too, and a row's arithmetic is the same
        whatever else the step holds: a prompt is prefilled the same way alone, batched, chunked
        or after a cached prefix."""
        return new_tokens == 1 or prefill_len <= min(MAX_PREFILL_TOKENS, ring_tokens or MAX_PREFILL_TOKENS)

    def _layers(self, kv) -> ctypes.Array:
        if self._table is None or self._kv is not kv:
            rows = []
            for i, layer in enumerate(self.model.layers):
                a, m = layer.self_attn, layer.mlp
                projections = [lin.qweight_c() for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj,
                                                           m.up_proj, m.down_proj)]
                if a.sliding:
                    j = kv.sliding.layer_index[i]
                    caches = (_ptr(kv.sliding.k[j]), _ptr(kv.sliding.v[j]), None, None)
                else:
                    j = kv.layer_index[i]
                    caches = (_ptr(kv.k[j]), _ptr(kv.v[j]), _ptr(kv.k_scale[j] if kv.quantized else None),
                              _ptr(kv.v_scale[j] if kv.quantized else None))
                rows.append((_ptr(layer.input_layernorm), *self._norms(layer), projections, *caches,
                             _ptr(a.q_norm), _ptr(a.k_norm), *self._post_norms(layer), int(a.sliding)))
            self._table = layer_table(rows)
            self._kv = kv
            self._inv_freq = self.model.inv_freq.float().contiguous()
            self._scale = self.model.layers[0].self_attn.scale
            local = getattr(self.model, "inv_freq_local", None)
            self._inv_freq_local = local.float().contiguous() if local is not None else None
            # the final norm in the same call where the model's own is this C kernel (the same function)
            norm_kernel = getattr(self.model, "norm_kernel", None)
            self._final_norm = _ptr(self.model.norm) if hasattr(norm_kernel, "rms_norm_rows_bf16") else None
        return self._table

    @staticmethod
    def _norms(layer) -> tuple:
        """(the feed-forward's input norm,): Gemma names it ``pre_feedforward_layernorm``."""
        return (_ptr(getattr(layer, "pre_feedforward_layernorm", layer.post_attention_layernorm)),)

    @staticmethod
    def _post_norms(layer) -> tuple:
        """Gemma's norms of the attention's and the feed-forward's outputs, or (None, None)."""
        if not hasattr(layer, "post_feedforward_layernorm"):
            return None, None
        return _ptr(layer.post_attention_layernorm), _ptr(layer.post_feedforward_layernorm)

    def _arch(self, meta, positions: torch.Tensor, seq_of_row: torch.Tensor | None,
              keep: list) -> tuple[DecodeArch | None, tuple]:
        """What decode.c needs beyond Llama's layer for this step (None for Llama's), and for a
        model with sliding-window layers each row's ring arrays (its sequence's ring table
        ``[T, ring_max_blocks]`` and its write slot ``[T]``, int64: `DecodeArch`'s per-row fields),
        which each call of the step points into at its first row; `keep` holds the tensors whose
        addresses it carries until the calls return."""
        model = self.model
        gemma = model.config.architecture == "gemma3"
        sm = meta.sliding
        if not gemma and sm is None:
            return None, ()
        arch = DecodeArch(gemma=int(gemma))
        if self._inv_freq_local is not None:
            arch.inv_freq_local = self._inv_freq_local.data_ptr()
        rings = ()
        if sm is not None:
            if sm.write_rows.shape[0] != positions.shape[0]:  # (`takes` leaves no prefill row unwritten)
                raise ValueError("a sliding-window step in one call writes every row's key")
            tables = sm.ring_tables if seq_of_row is None else sm.ring_tables[seq_of_row]
            rings = (tables.contiguous(), sm.write_slots.contiguous())
            keep += rings
            arch.ring_max_blocks, arch.ring_NB = rings[0].shape[1], self._kv.sliding.num_blocks
            arch.window = sm.window
        return arch, rings

    def _lora_table(self, batch) -> ctypes.Array:
        """The `LoRAWeights` of every projection for the adapters of `batch` (`lora.slots.LoRABatch`),
        made once per set of adapters (and again after one is loaded or unloaded)."""
        key = (batch.ids, batch.version)
        if self._lora[0] != key:
            entries, keep = [], []
            for layer in self.model.layers:
                a, m = layer.self_attn, layer.mlp
                for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
                    stacks = lin.lora.stacks(self.model.dtype) if lin.lora is not None else None
                    if stacks is None:
                        entries.append(LoRAWeights())
                        continue
                    a_, b_t = stacks
                    (r, n), k = b_t.shape, a_.shape[1]  # pairs interleaved, for the bf16 dot products
                    b2 = b_t.view(r // 2, 2, n).transpose(1, 2).contiguous() if r % 2 == 0 else None
                    a2 = a_.view(r, k // 2, 2).transpose(0, 1).contiguous() if k % 2 == 0 else None
                    keep.append((a_, b_t, b2, a2))
                    entries.append(LoRAWeights(a_.data_ptr(), b_t.data_ptr(), None if b2 is None else b2.data_ptr(),
                                               None if a2 is None else a2.data_ptr(), r))
            self._lora = (key, ((LoRAWeights * len(entries))(*entries), keep))
        return self._lora[1][0]

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, kv, meta, lora=None) -> torch.Tensor | None:
        """h ``[T, hidden]`` bf16 (the embeddings of the step's T new tokens, each sequence's
        rows ones it `takes`; a fresh tensor, which this updates in place) -> the final hidden
        states (after the model's final norm: in the C call where the model's norm is that
        kernel, else by `final_norm`), or None (counted: `kernels.count_fallback`) when the
        kernel refuses them, which `supports` rules out at load. Row i attends to
        ``positions[i] + 1`` keys through its sequence's block table; rows go in calls of at most
        `decode_step.ROWS_PER_CALL` (in order: a row's keys are written by then).
        `lora`: the pass's `lora.slots.LoRABatch` when a row has an adapter (each row adds its own).

        Run right after the last step's weights went through the caches, each PyTorch operation
        here costs tens of microseconds (`benchmarks/cold_ops.py`), so the calls' rows are
        addressed by arithmetic on the tensors' addresses, not by indexing them."""
        h, positions, slots = (x.contiguous() for x in (h, positions, meta.slot_mapping))
        t = h.shape[0]
        seq_of_row = None
        if meta.num_decodes == meta.num_seqs:
            tables = meta.block_tables if meta.block_tables.shape[0] == t else meta.block_tables[:t]
            tables = tables.contiguous()
        else:  # each row reads its own sequence's table
            qsl = torch.tensor(meta.query_start_loc)
            seq_of_row = torch.repeat_interleave(torch.arange(meta.num_seqs), qsl.diff())
            tables = meta.block_tables[seq_of_row]
        table, keep = self._layers(kv), []
        arch, rings = self._arch(meta, positions, seq_of_row, keep)
        adapters = self._lora_table(lora) if lora is not None and lora.ids else None
        row_bytes = h.shape[1] * h.element_size()
        width = tables.shape[1]
        for a in range(0, t, ROWS_PER_CALL):
            n = min(ROWS_PER_CALL, t - a)
            rows = LoRAStep(ctypes.addressof(adapters), lora.row_start[a].data_ptr(),
                            lora.row_rank[a].data_ptr()) if adapters is not None else None
            if rings:  # this call's rows of the ring arrays
                arch.ring_tables = rings[0].data_ptr() + 8 * a * arch.ring_max_blocks
                arch.ring_slots = rings[1].data_ptr() + 8 * a
            rc = decode_layers(self.lib, table, self.model.config, h.data_ptr() + a * row_bytes, n,
                               self._inv_freq.data_ptr(), positions.data_ptr() + 8 * a, slots.data_ptr() + 8 * a,
                               tables.data_ptr() + 8 * a * width, width, kv.num_blocks, kv.block_size,
                               self._scale, arch, rows, self._final_norm)
            if rc != 0:
                count_fallback("native decode step")
                return None
        return h if self._final_norm is not None else self.model.final_norm(h, in_place=True)
