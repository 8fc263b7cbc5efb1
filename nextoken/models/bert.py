"""BERT (Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional Transformers"), the encoder
behind sentence-embedding models such as all-MiniLM-L6-v2 (Reimers & Gurevych 2019,
"Sentence-BERT"). Unlike the decoders in this folder: every token attends to every token of its
sequence (no causal mask, no KV cache: one pass, nothing kept), positions are learned absolute
embeddings, and each sublayer's LayerNorm comes after its residual add (post-norm):

    h = LN(word[ids] + position[p] + token_type[0])
    for each layer:
        a = LN(h + Wo softmax(q k^T / sqrt(D)) v),   q, k, v = Wq h + bq, Wk h + bk, Wv h + bv
        h = LN(a + W2 gelu(W1 a + b1) + b2)          gelu: the exact (erf) form

A batch is the sequences' tokens packed one after another (``[T]``, no padding) through the
linears and norms. Attention and each residual add + LayerNorm run in C where the execution plan
binds the ``encoder`` kernel (`kernel`: per sequence and head, no padding); else (the reference)
attention takes runs of sequences of similar length padded to their longest (``[B, H, L, D]``,
padding keys masked), one call per run (`attention_groups`). The tensor names are those of
`transformers`' ``BertModel`` (with or without a ``bert.`` prefix); the reference test compares
against it on a tiny random config, on both paths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nextoken.errors import ModelLoadError
from nextoken.kernels import bf16_matmul_native, count_fallback


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int
    layer_norm_eps: float

    @classmethod
    def from_hf(cls, c: dict, where: str = "config.json") -> BertConfig:
        """From a ``config.json`` dict; `ModelLoadError` naming a missing key or an activation
        other than GELU."""
        try:
            cfg = cls(int(c["vocab_size"]), int(c["hidden_size"]), int(c["num_hidden_layers"]),
                      int(c["num_attention_heads"]), int(c["intermediate_size"]), int(c["max_position_embeddings"]),
                      int(c.get("type_vocab_size", 2)), float(c.get("layer_norm_eps", 1e-12)))
        except KeyError as exc:
            raise ModelLoadError(f"{where}: key {exc.args[0]!r} is missing") from None
        if c.get("hidden_act", "gelu") != "gelu" or c.get("position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(f"{where}: only GELU activations and absolute positions are supported")
        return cfg


class BertModel:
    """The encoder's weights (as named in `transformers`) and its forward pass."""

    def __init__(self, cfg: BertConfig, tensors: dict[str, torch.Tensor]):
        self.config = cfg
        self.w = tensors  # name -> tensor, without the ``bert.`` prefix
        self.codes: dict = {}  # linear name -> its `PackedS8` (Q8_0), or `QuantWeight` and float32 bias (`quantize`)
        self.lib = None
        self.kernel = None  # the plan's ``encoder`` library (kernels/encoder.c): attention, add + norm, GELU in C
        self._observed: dict | None = None  # linear name -> its inputs' column maxima, during `_calibrate`

    @classmethod
    def from_dir(cls, d, dtype: torch.dtype = torch.float32) -> BertModel:
        """Load from a Hugging Face folder (`loader.hf.HFModelDir`). Raises `ModelLoadError` for a
        missing tensor or one of another shape than the config says."""
        cfg = BertConfig.from_hf(d.hf_config, f"{d.path}/config.json")
        prefix = "bert." if d.has_tensor("bert.embeddings.word_embeddings.weight") else ""
        h, i = cfg.hidden_size, cfg.intermediate_size
        shapes = {"embeddings.word_embeddings.weight": (cfg.vocab_size, h),
                  "embeddings.position_embeddings.weight": (cfg.max_positions, h),
                  "embeddings.token_type_embeddings.weight": (cfg.type_vocab_size, h),
                  "embeddings.LayerNorm.weight": (h,), "embeddings.LayerNorm.bias": (h,)}
        for n in range(cfg.num_layers):
            p = f"encoder.layer.{n}."
            for m in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
                shapes[p + m + ".weight"], shapes[p + m + ".bias"] = (h, h), (h,)
            shapes[p + "intermediate.dense.weight"], shapes[p + "intermediate.dense.bias"] = (i, h), (i,)
            shapes[p + "output.dense.weight"], shapes[p + "output.dense.bias"] = (h, i), (h,)
            for m in ("attention.output.LayerNorm", "output.LayerNorm"):
                shapes[p + m + ".weight"], shapes[p + m + ".bias"] = (h,), (h,)
        tensors = {}
        for name, shape in shapes.items():
            t = d.tensor(prefix + name, dtype)
            if tuple(t.shape) != shape:
                raise ModelLoadError(f"{d.path}: tensor {prefix + name} has shape {tuple(t.shape)}, expected {shape}")
            tensors[name] = t
        for n in range(cfg.num_layers):  # q, k and v as one matmul: one pass over the activations
            p = f"encoder.layer.{n}.attention.self."
            for part in ("weight", "bias"):
                tensors[f"{p}qkv.{part}"] = torch.cat([tensors.pop(f"{p}{m}.{part}") for m in ("query", "key", "value")])
        return cls(cfg, tensors)

    @property
    def dtype(self) -> torch.dtype:
        return self.w["embeddings.word_embeddings.weight"].dtype

    @property
    def device(self) -> torch.device:
        return self.w["embeddings.word_embeddings.weight"].device

    def to(self, device: torch.device) -> BertModel:
        """Move the weights to `device` (a GPU: its matmuls and attention run there); returns self.
        A quantized encoder stays on the CPU (its codes run on our C kernel)."""
        if self.codes and device.type != "cpu":
            raise ModelLoadError("a quantized encoder (--quantization) runs on the CPU's kernels; on a GPU it runs "
                                 "dense")
        self.w = {name: t.to(device) for name, t in self.w.items()}
        return self

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """input_ids ``[T]`` (the sequences packed, ``sum(seq_lens) == T``, on the weights'
        device) -> the last layer's hidden states ``[T, hidden]``. Positions restart at 0 for each
        sequence; token type 0."""
        w, cfg, dev = self.w, self.config, self.device
        positions = torch.cat([torch.arange(n, device="cpu") for n in seq_lens]).to(dev)
        x = w["embeddings.word_embeddings.weight"][input_ids] + w["embeddings.position_embeddings.weight"][positions]
        x = x + w["embeddings.token_type_embeddings.weight"][0]
        x = self._norm(x, "embeddings.LayerNorm")
        if self._c_kernel(x) is not None:  # the sequences' starts and lengths, for the C attention
            seqs = (torch.tensor([0, *seq_lens[:-1]], device="cpu").cumsum(0), torch.tensor(seq_lens, device="cpu"))
        else:
            seqs = attention_groups(seq_lens, device=dev)
        for n in range(cfg.num_layers):
            p = f"encoder.layer.{n}."
            a = self._attention(x, p + "attention.", seqs)
            x = self._add_norm(x, self._linear(a, p + "attention.output.dense", x), p + "attention.output.LayerNorm")
            m = self._gelu(self._linear(x, p + "intermediate.dense"))
            x = self._add_norm(x, self._linear(m, p + "output.dense", x), p + "output.LayerNorm")
        return x

    __call__ = forward

    def _c_kernel(self, x: torch.Tensor):
        """The C library when it runs this pass (on the CPU, in float32 or bf16), else None."""
        ok = self.kernel is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
        return self.kernel if ok else None

    def quantize(self, type_name: str, kernels, calibration: list[list[int]] | None = None) -> None:
        """Every linear's weight as GGUF blocks of `type_name` (``"Q8_0"``, ...: the `gguf`
        package's quantizers, `loader.quantize`) on our kernels (`kernels`: the plan's
        `KernelSet`). Q8_0 runs the encoder's int8 GEMM (`PackedS8`, ``encoder_linear_s8``:
        activations quantized per block of 32 to 7-bit codes with a minimum), smoothed by the
        activations' column maxima of one float pass over the `calibration` sequences (token
        ids; `calibration_ids`) where given; another format the ``qmatmul`` library
        (activations per block of 32 as Q8_0/Q8_1). The embedding tables, norms and biases stay
        as they are. Raises `ModelLoadError` when the kernel is missing."""
        from nextoken.layers.quantization.qweight import from_gguf
        from nextoken.loader.quantize import quantize_rows

        gemm = type_name == "Q8_0"
        self.lib = kernels.encoder if gemm else kernels.qmatmul
        if self.lib is None:
            raise ModelLoadError(f"a quantized encoder needs our {'encoder' if gemm else 'qmatmul'} kernel (the plan "
                                 "has none: enforce_eager, NEXTOKEN_NATIVE_KERNELS=0 or no C compiler)")
        act_max = self._calibrate(calibration) if gemm and calibration else {}
        for name in [n for n in self.w if n.startswith("encoder.") and n.endswith(".weight") and "LayerNorm" not in n]:
            w, linear = self.w.pop(name).float(), name.removesuffix(".weight")
            bias = self.w[linear + ".bias"].float()
            self.codes[linear] = PackedS8.quantize(w, bias, act_max.get(linear)) if gemm else \
                (from_gguf(quantize_rows(w, type_name), type_name, *w.shape), bias)

    def _calibrate(self, sequences: list[list[int]]) -> dict[str, torch.Tensor]:
        """One float pass over `sequences`: each linear's input columns' largest magnitude."""
        seen: dict[str, torch.Tensor] = {}
        self._observed = seen
        try:
            ids = torch.tensor([i for s in sequences for i in s], device=self.device)
            self.forward(ids, [len(s) for s in sequences])
        finally:
            self._observed = None
        return seen

    def _linear(self, x: torch.Tensor, name: str, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T + b. A quantized linear whose output joins the `residual` in the C add + norm
        gives it in float32 (rounded once, after the sum)."""
        quantized = self.codes.get(name)
        if self._observed is not None:  # (a calibration pass: `_calibrate`)
            m = x.detach().abs().amax(0).float()
            self._observed[name] = torch.maximum(self._observed[name], m) if name in self._observed else m
        if quantized is None:
            w, b = self.w[name + ".weight"], self.w[name + ".bias"]
            if x.dtype == torch.bfloat16 and x.device.type == "cpu" and not bf16_matmul_native():
                # widened and rounded once, which is what PyTorch's bf16 matmul computes, 5x faster
                # where it emulates bf16 (MiniLM's 200 texts: 2.2 s against 10.9 on Zen 3)
                return F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16)
            return F.linear(x, w, b)
        out = torch.float32 if residual is not None and self._c_kernel(residual) is not None else x.dtype
        if isinstance(quantized, PackedS8):
            return quantized(x, self.lib, out)
        from nextoken.layers.quantization.qweight import qmatmul

        codes, bias = quantized
        return qmatmul(x.contiguous(), codes, bias, out_dtype=out, lib=self.lib)

    def _gelu(self, x: torch.Tensor) -> torch.Tensor:
        """GELU (erf form) in C (`encoder_gelu`, in place on the fresh intermediate), or PyTorch's
        F.gelu (the reference)."""
        c = self._c_kernel(x)
        if c is None or self._observed is not None or not x.is_contiguous():
            return F.gelu(x)
        c.encoder_gelu(x.data_ptr(), int(x.dtype == torch.bfloat16), x.numel(), x.data_ptr())
        return x

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.w[name + ".weight"], self.w[name + ".bias"],
                            self.config.layer_norm_eps)

    def _add_norm(self, x: torch.Tensor, r: torch.Tensor, name: str) -> torch.Tensor:
        """LayerNorm(x + r) with the weights of `name`: one pass in C (`encoder_add_norm`), or
        PyTorch's add then layer_norm (the reference)."""
        c = self._c_kernel(x)
        if c is not None and r.dtype in (x.dtype, torch.float32):
            out = torch.empty_like(x)
            x, r = x.contiguous(), r.contiguous()
            if not c.encoder_add_norm(x.data_ptr(), r.data_ptr(), int(r.dtype != x.dtype),
                                      self.w[name + ".weight"].data_ptr(),
                                      self.w[name + ".bias"].data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0],
                                      x.shape[1], self.config.layer_norm_eps, out.data_ptr()):
                return out
            count_fallback("encoder_add_norm")
        return self._norm(x + r.to(x.dtype), name)

    def _attention(self, x: torch.Tensor, p: str, seqs) -> torch.Tensor:
        """Bidirectional attention within each packed sequence: x ``[T, hidden]`` -> ``[T, hidden]``.
        In C (`seqs`: the sequences' starts and lengths, int64): per sequence and head, no
        padding. Else (`seqs`: `Group`s) each group of sequences of similar length is laid out
        padded, ``[B, H, L, D]``, for one batched call of PyTorch's attention; the mask hides each
        sequence's padding keys, and the padding rows are dropped again (the reference)."""
        t, h = x.shape
        heads = self.config.num_heads
        qkv = self._linear(x, p + "self.qkv")
        if isinstance(seqs, tuple):  # (`forward` chose the C kernel for this pass)
            c, (starts, lens) = self.kernel, seqs
            out = torch.empty(t, h, dtype=qkv.dtype, device=qkv.device)
            qkv = qkv.contiguous()
            if not c.encoder_attention(qkv.data_ptr(), int(qkv.dtype == torch.bfloat16), t, h, heads, starts.data_ptr(),
                                       lens.data_ptr(), len(lens), out.data_ptr()):
                return out
            count_fallback("encoder_attention")
            seqs = attention_groups(lens.tolist())
        q, k, v = qkv.split(h, dim=-1)
        out = torch.empty_like(q)
        for g in seqs:
            b = g.keep.shape[0]
            qkv = []
            for z in (q, k, v):
                padded = z.new_zeros(b * g.longest, h)
                padded[g.rows] = z[g.start : g.end]
                qkv.append(padded.view(b, g.longest, heads, h // heads).transpose(1, 2))
            mask = None if g.full else g.keep[:, None, None, :]
            o = F.scaled_dot_product_attention(*qkv, attn_mask=mask)  # [B, H, L, D]
            out[g.start : g.end] = o.transpose(1, 2).reshape(b * g.longest, h)[g.rows]
        return out


@dataclass(frozen=True)
class Group:
    """Consecutive packed sequences attended in one call: their tokens ``[start, end)`` of the
    pass, the tokens' rows in the padded ``[B * L]`` layout, the mask of real tokens ``[B, L]``,
    and whether every sequence fills it (no padding: no mask)."""

    start: int
    end: int
    rows: torch.Tensor
    keep: torch.Tensor
    longest: int
    full: bool = False


def attention_groups(seq_lens: list[int], max_padding: float = 0.25, device: torch.device | None = None) -> list[Group]:
    """`seq_lens` (in pass order) cut into runs of consecutive sequences whose padded size,
    count x longest, stays within ``1 + max_padding`` of their tokens (few calls, little padding
    when the sequences are sorted by length, as `embedding.EmbeddingModel` sorts them); the
    groups' tensors on `device` (default the CPU)."""
    groups, at, i = [], 0, 0
    while i < len(seq_lens):
        j, longest, total = i + 1, seq_lens[i], seq_lens[i]
        while j < len(seq_lens):
            m = max(longest, seq_lens[j])
            if m * (j + 1 - i) > (1 + max_padding) * (total + seq_lens[j]):
                break
            longest, total, j = m, total + seq_lens[j], j + 1
        lens = seq_lens[i:j]
        rows = torch.cat([torch.arange(n, device="cpu") + r * longest for r, n in enumerate(lens)])
        keep = torch.arange(longest, device="cpu")[None, :] < torch.tensor(lens, device="cpu")[:, None]
        groups.append(Group(at, at + total, rows.to(device), keep.to(device), longest, all(n == longest for n in lens)))
        at, i = at + total, j
    return groups


@dataclass(frozen=True)
class PackedS8:
    """A linear's weight ``[N, K]`` as GGUF Q8_0 (`loader.quantize.quantize_rows`: per block of
    32 weights of a row, int8 codes and one scale) packed for ``encoder_linear_s8``
    (kernels/encoder.c): panels of 16 output columns, codes ``[P, K/4, 16, 4]`` int8, the blocks'
    scales `dw` and scaled code sums `ws` (``dw * sum(codes)``) ``[P, K/32, 16]`` float32, with
    ``P = ceil(N / 16)`` (the last panel padded with zeros); the bias float32 ``[N]``; and
    `smooth` ``[K]`` float32 or None: SmoothQuant's factors (Xiao et al. 2023, "SmoothQuant"),
    each input column's activations multiplied by ``1 / s_j`` before they are quantized and the
    weight's column by ``s_j`` before it is, ``s_j = max|x_j|^a / max|W_j|^(1 - a)`` (a = 0.5):
    the product is unchanged, and an outlier column's range moves into the weight, where every
    block has its own scale. On all-MiniLM-L6-v2 (the maxima from `calibration_ids`' random
    tokens) the minimum cosine against float32 on 200 texts goes from 0.99900 to 0.99954."""

    codes: torch.Tensor
    dw: torch.Tensor
    ws: torch.Tensor
    bias: torch.Tensor
    out_features: int
    in_features: int
    smooth: torch.Tensor | None = None

    @classmethod
    def quantize(cls, w: torch.Tensor, bias: torch.Tensor, act_max: torch.Tensor | None = None,
                 alpha: float = 0.5) -> PackedS8:
        """From a float weight ``[N, K]`` (K a multiple of 32, else `ModelLoadError`), smoothed
        where `act_max` (``[K]``: each input column's largest magnitude seen) is given."""
        from nextoken.loader.quantize import quantize_rows

        n, k = w.shape
        if k % 32:
            raise ModelLoadError(f"an int8 encoder needs linears of a multiple of 32 inputs, not {k}")
        smooth = None
        if act_max is not None:
            s = act_max.float().clamp_min(1e-5) ** alpha / w.float().abs().amax(0).clamp_min(1e-5) ** (1 - alpha)
            w, smooth = w.float() * s, (1.0 / s).contiguous()
        blocks = quantize_rows(w.float(), "Q8_0").view(n, k // 32, 34)  # per block: fp16 scale, 32 int8
        scale = blocks[:, :, :2].contiguous().view(torch.float16).float().view(n, k // 32)
        codes = blocks[:, :, 2:].contiguous().view(torch.int8).reshape(n, k)
        pad = -n % 16
        codes = F.pad(codes, (0, 0, 0, pad))
        scale = F.pad(scale, (0, 0, 0, pad))
        sums = codes.view(-1, k // 32, 32).sum(-1, dtype=torch.int32).float() * scale
        p = (n + pad) // 16
        return cls(codes.view(p, 16, k // 4, 4).transpose(1, 2).contiguous(),
                   scale.view(p, 16, k // 32).transpose(1, 2).contiguous(),
                   sums.view(p, 16, k // 32).transpose(1, 2).contiguous(), bias.float().contiguous(), n, k, smooth)

    def dequantized(self) -> torch.Tensor:
        """The weight the codes stand for, float32 ``[N, K]``, smoothed (the reference's)."""
        p, k = self.codes.shape[0], self.in_features
        codes = self.codes.transpose(1, 2).reshape(p * 16, k).float()
        scale = self.dw.transpose(1, 2).reshape(p * 16, k // 32)
        return (codes.view(-1, k // 32, 32) * scale[..., None]).view(-1, k)[: self.out_features]

    def __call__(self, x: torch.Tensor, lib, out_dtype: torch.dtype) -> torch.Tensor:
        """x ``[T, K]`` float32 or bf16 -> ``[T, N]`` of `out_dtype` (float32 or bf16) on `lib`."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=out_dtype)
        smooth = None if self.smooth is None else self.smooth.data_ptr()
        if lib.encoder_linear_s8(x.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0], self.in_features, smooth,
                                 self.codes.data_ptr(), self.dw.data_ptr(), self.ws.data_ptr(), self.bias.data_ptr(),
                                 self.out_features, int(out_dtype == torch.bfloat16), out.data_ptr()):
            raise MemoryError(f"encoder_linear_s8: no memory for the int8 codes of {x.shape[0]} rows")
        return out


def quantize_u7(x: torch.Tensor, smooth: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The reference of the kernel's activation quantization: x ``[T, K]`` (times `smooth`
    ``[K]`` where given) -> its 7-bit codes, steps and minima (per row and block of 32: ``q =
    round((x - min) / d)``, ``d = (max - min) / 127``; ``[T, K/32, 32]``, ``[T, K/32, 1]`` twice),
    float32, computed as the C code computes them."""
    t, k = x.shape
    v = (x.float() if smooth is None else x.float() * smooth).view(t, k // 32, 32)
    lo, hi = v.amin(-1, keepdim=True), v.amax(-1, keepdim=True)
    step = (hi - lo) / 127.0
    inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    q = torch.round((v - lo) * inv).clamp(max=127)
    return q, step, lo


def calibration_ids(specials: list[int], vocab_size: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """Sequences of random token ids (fixed seed; ids from the upper part of the vocabulary, past
    BERT's special and unused entries), 8 to 200 long, each framed by the tokenizer's special
    tokens `specials` (what it puts around an empty text: ``[CLS] [SEP]``): the calibration
    pass of an int8 encoder (`BertModel.quantize`). Its outlier columns are the model's own, so
    random tokens find them as well as real texts do (simulated on all-MiniLM-L6-v2: the same
    minimum cosine on 200 texts, 0.99953 against 0.99952 from 64 texts)."""
    g = torch.Generator().manual_seed(seed)
    low = min(1000, vocab_size // 4)
    out = []
    for n in (8, 16, 24, 32, 48, 64, 128, 200):
        n = max(1, min(n, max_len - len(specials)))
        body = torch.randint(low, vocab_size, (n,), generator=g).tolist()
        out.append(specials[:1] + body + specials[1:])
    return out
