"""Token embeddings: a table of ``[vocab, hidden]`` rows, dense or kept quantized."""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from nextoken.layers.quantization.methods import load_codes, store_dense
from nextoken.layers.quantization.qweight import QuantWeight
from nextoken.layers.quantization.ggml import QK, f16_field


C_LOOKUP_ROWS = 64  # lookups of at most this many rows (decode steps) run on the C kernel


class Embedding(torch.nn.Module):
    """``input_ids [T] -> [T, hidden]`` in `dtype`.

    The weight is dense; or (after `set_qweight`) the GGUF codes of any block format
    (`qweight.QuantWeight`, shared with a tied LM head); or (after `set_q8_0`, the PyTorch path)
    the Q8_0 blocks as int8 values and float32 scales. A quantized lookup de-quantizes only the
    rows it reads, as `quantization.ggml` does, so the table stays at its GGUF size.

    Under tensor parallelism the table holds rows ``[vocab_start, vocab_start + vocab_size)`` of
    the vocabulary; other ids look up zeros, and `combine` (an all-reduce) sums the ranks' rows
    (Megatron-LM's vocabulary-parallel embedding).
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.vocab_size, self.hidden_size, self.dtype = vocab_size, hidden_size, dtype
        self.weight = torch.nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)
        self.q8: tuple[torch.Tensor, torch.Tensor] | None = None
        self.qweight: QuantWeight | None = None
        self.vocab_start, self.combine = 0, None  # tensor parallel: this rank's first row, the all-reduce
        self.lookup_kernel = None  # set by the execution plan at load: the codes' rows expanded in C

    def weight_loader(self, t, plan) -> None:
        """The loader's hook: store checkpoint tensor `t` (`loader.weights.CheckpointTensor`,
        ``[vocab, hidden]``) in the form `plan` chooses for its type (codes, Q8_0, dense)."""
        form = plan.embedding_form(t.type_name, self.vocab_size, self.hidden_size)
        if form == "codes":
            self.set_qweight(load_codes(t))
        elif form == "q8_0":
            self.set_q8_0(t.raw())
        else:
            self.weight = store_dense(self.weight, t, self.dtype)

    def set_qweight(self, qweight: QuantWeight) -> None:
        self.qweight = qweight
        self.weight = None

    def set_q8_0(self, raw: torch.Tensor) -> None:
        """raw: the tensor's Q8_0 blocks, uint8 ``[vocab, hidden // 32 * 34]``."""
        b = raw.reshape(-1, 2 + QK)
        d = f16_field(b, 0).reshape(self.vocab_size, self.hidden_size // QK)
        q = b[:, 2:].contiguous().view(torch.int8).reshape(self.vocab_size, self.hidden_size)
        self.q8 = (q, d)
        self.weight = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.combine is None:
            return self.lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_size)
        rows = self.lookup(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0)
        return self.combine(rows)

    def lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows `input_ids` (of this table) -> ``[T, hidden]``."""
        if self.qweight is not None:
            fast = self._lookup_c(input_ids) if self.lookup_kernel is not None else None
            return fast if fast is not None else self.qweight.lookup(input_ids).to(self.dtype)
        if self.q8 is None:
            return F.embedding(input_ids, self.weight)
        q, d = self.q8
        rows = q[input_ids].view(-1, self.hidden_size // QK, QK).float() * d[input_ids][..., None]
        return rows.view(-1, self.hidden_size).to(self.dtype)

    def _lookup_c(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The codes' rows in bf16 by ``qlookup_bf16`` (kernels/qmatmul.c: the same float32
        arithmetic as `QuantWeight.lookup` and one rounding, so the same bits; 4 us for one row
        of Qwen2.5-0.5B where the PyTorch ops take 130); None where it does not apply (another
        dtype, an id outside the table: the PyTorch path then runs, or raises; more than
        `C_LOOKUP_ROWS` rows, where PyTorch's vectorized ops on both threads are as fast: 2.0 ms
        against the C loop's 2.2 for a 512-token prompt of Qwen2.5-1.5B)."""
        if self.dtype != torch.bfloat16 or input_ids.device.type != "cpu" or input_ids.numel() > C_LOOKUP_ROWS:
            return None
        ids = input_ids if input_ids.dtype == torch.int64 else input_ids.to(torch.int64)  # (no call: see `runner.inputs`)
        ids = ids if ids.is_contiguous() else ids.contiguous()
        out = torch.empty(ids.shape[0], self.hidden_size, dtype=torch.bfloat16)
        c = self.qweight.c_struct()
        if self.lookup_kernel.qlookup_bf16(ctypes.byref(c), ids.data_ptr(), ids.shape[0], out.data_ptr()) != 0:
            return None
        return out

    @property
    def nbytes(self) -> int:
        if self.qweight is not None:
            return self.qweight.nbytes
        return self.weight.nbytes if self.q8 is None else sum(t.nbytes for t in self.q8)
