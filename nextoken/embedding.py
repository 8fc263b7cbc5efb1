"""Sentence embeddings: text -> tokens -> encoder -> pooling -> normalisation, batched.

`EmbeddingModel` opens a sentence-transformers folder (the catalog's ``all-minilm-l6-v2``, or any
BERT-family folder laid out the same way):

- ``config.json`` and the safetensors weights: the encoder (`models.bert`);
- ``tokenizer.json``: the tokenizer, by the `tokenizers` library (WordPiece for BERT; its
  post-processor adds ``[CLS]`` and ``[SEP]``);
- ``modules.json``, ``1_Pooling/config.json``: pooling (``mean`` over the tokens, the ``cls``
  token's state, or the ``last`` token's) and whether a ``Normalize`` module follows (unit
  length); ``sentence_bert_config.json``: ``max_seq_length`` (longer inputs are refused, or cut
  with `truncate`).

Inputs are batched by length (sorted, packed without padding, at most `max_batch_tokens` tokens a
pass); each vector comes back in its input's place. Token-id inputs are used as given (no special
tokens added). ``dimensions`` cuts a vector to its first entries (then renormalises) only for a
model trained for it (Matryoshka: ``matryoshka_dimensions`` in its config); other models refuse it.
Raises `InvalidRequest` naming the input for an empty one, one too long, or a token id out of range.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

from nextoken.errors import InvalidRequest, ModelLoadError
from nextoken.runner.device import CPU, Device
from nextoken.runner.plan import ExecutionPlan

log = logging.getLogger("nextoken.embedding")

POOLING_MODES = ("mean", "cls", "last")


@dataclass(frozen=True)
class Embeddings:
    """`vectors` float32 ``[N, dim]`` in input order; `num_tokens` and `token_ids` per input."""

    vectors: torch.Tensor
    num_tokens: list[int]
    token_ids: list[list[int]]


def encoder_dtype(name: str = "auto", device: torch.device | None = None) -> torch.dtype:
    """The encoder's dtype for an engine ``dtype`` option: "float32" (the exact reference, equal to
    sentence-transformers within 1e-4), "bfloat16", or "auto": bfloat16 where the CPU multiplies
    bf16 matrices in hardware at a rate that pays (`kernels.bf16_matmul_native`: AVX512-BF16 or
    AMX, timed against float32; with AMX PyTorch's bf16 matmul is about 3x its float32 one), else
    float32 (elsewhere bf16 matmuls are emulated, or slower than float32); on a GPU (`device`),
    bfloat16. Raises `InvalidRequest` for another name."""
    from nextoken.kernels import bf16_matmul_native

    if name in ("float32", "fp32"):
        return torch.float32
    if name in ("bfloat16", "bf16"):
        return torch.bfloat16
    if name == "auto":
        gpu = device is not None and device.type != "cpu"
        return torch.bfloat16 if gpu or bf16_matmul_native() else torch.float32
    raise InvalidRequest(f"dtype {name!r} is not one an encoder runs in: auto, bfloat16 or float32", "dtype")


class EmbeddingModel:
    """An encoder, its tokenizer and its pooling, from a sentence-transformers folder `path`;
    `dtype`: its weights' and activations' (pooling and normalisation run in float32);
    `quantization`: a GGUF block format its linears are quantized to at load (``"q8_0"``, ...);
    `device`: where the encoder runs (a GPU too; the vectors come back to the CPU). What runs
    where is the execution plan's choice, as for a generation model (`runner.plan`: the kernels
    resolved once, `enforce_eager` PyTorch alone), logged in one line (`describe`).
    Raises `ModelLoadError` when a file is missing or names something not supported, and
    `InvalidRequest` for a choice the device cannot run (a quantized encoder on a GPU)."""

    def __init__(self, path: str | os.PathLike, dtype: torch.dtype = torch.float32, max_batch_tokens: int = 8192,
                 quantization: str | None = None, device: torch.device | None = None, enforce_eager: bool = False):
        from tokenizers import Tokenizer

        from nextoken.loader.hf import HFModelDir
        from nextoken.models.bert import BertModel, calibration_ids

        self.path = str(path)
        folder = HFModelDir(self.path)
        if folder.hf_config.get("model_type") != "bert":
            raise ModelLoadError(f"{self.path}: an embedding model must be BERT-family (model_type 'bert'), got "
                                 f"{folder.hf_config.get('model_type')!r}")
        self.plan = ExecutionPlan.choose(dtype, enforce_eager=enforce_eager, keep_quantized=False,
                                         quantization=quantization, device=_plan_device(device))
        self.encoder = BertModel.from_dir(folder, dtype)
        tok_path = os.path.join(self.path, "tokenizer.json")
        if not os.path.isfile(tok_path):
            raise ModelLoadError(f"{self.path}: tokenizer.json is missing")
        self.tokenizer = Tokenizer.from_file(tok_path)
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        if quantization is not None:  # ``--quantization q8_0``: the encoder's linears on our int8 kernel
            cfg = self.encoder.config
            calibration = calibration_ids(self.tokenizer.encode("").ids, cfg.vocab_size, cfg.max_positions)
            self.encoder.quantize(quantization.upper(), self.plan.kernels, calibration)
        if self.plan.device.is_cuda:
            self.encoder.to(self.plan.device.torch)
        else:  # attention and add + LayerNorm in C (kernels/encoder.c), where the plan has it
            self.encoder.kernel = self.plan.kernels.encoder
        self.pooling, self.normalize = _pooling(self.path)
        st = _read_json(os.path.join(self.path, "sentence_bert_config.json"))
        self.max_seq_length = min(int(st.get("max_seq_length", 512)), self.encoder.config.max_positions)
        self.matryoshka = folder.hf_config.get("matryoshka_dimensions") or []
        self.max_batch_tokens = max_batch_tokens
        log.info(self.describe())

    def describe(self) -> str:
        """The encoder's plan in one line: dtype, its linears (GGUF codes on our kernel, or
        PyTorch's matmul), attention, pooling; and why a fast path is off."""
        n = sum(1 for name in self.encoder.w if name.endswith(".weight") and name.startswith("encoder.")
                and "LayerNorm" not in name) + len(self.encoder.codes)
        linears = f"{n} codes ({self.plan.quantization.upper()}, our kernel)" if self.encoder.codes \
            else f"{n} dense (PyTorch)"
        off = "; ".join(f"{k} off: {v}" for k, v in self.plan.reasons.items())
        rest = "attention (per sequence, no padding), add + LayerNorm: C" if self.encoder.kernel is not None \
            else "attention (padded groups), add + LayerNorm: PyTorch"
        return (f"encoder plan: {str(self.plan.dtype).removeprefix('torch.')} on {self.plan.device.describe()}; "
                f"linears: {linears}; {rest}; pooling: {self.pooling}"
                f"{', normalized' if self.normalize else ''}" + (f"; {off}" if off else ""))

    @property
    def dimension(self) -> int:
        return self.encoder.config.hidden_size

    def tokenize(self, inputs: list[str | list[int]], truncate: bool | int = False) -> list[list[int]]:
        """Token ids of each input (strings encoded with special tokens; id lists as given).
        `truncate`: False, an input longer than the model takes is refused; True or -1, it is cut
        to that length; a number k >= 1, every input is cut to at most k tokens (vLLM's
        ``truncate_prompt_tokens``; a text keeps its final separator). Raises `InvalidRequest`."""
        if not isinstance(truncate, bool) and (not isinstance(truncate, int) or truncate == 0 or truncate < -1):
            raise InvalidRequest(f"truncate_prompt_tokens must be -1 (the model's length) or >= 1, got {truncate!r}",
                                 "truncate_prompt_tokens")
        limit = self.max_seq_length if isinstance(truncate, bool) or truncate == -1 else min(truncate, self.max_seq_length)
        out = []
        for i, x in enumerate(inputs):
            if isinstance(x, str):
                if not x:
                    raise InvalidRequest(f"input[{i}] is an empty string", "input")
                ids = self.tokenizer.encode(x).ids
            else:
                ids = list(x)
                if not ids:
                    raise InvalidRequest(f"input[{i}] is an empty list of tokens", "input")
                bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.encoder.config.vocab_size]
                if bad:
                    raise InvalidRequest(f"input[{i}] holds token id {bad[0]!r}, outside the vocabulary "
                                         f"(0..{self.encoder.config.vocab_size - 1})", "input")
            if len(ids) > limit:
                if truncate is False:
                    raise InvalidRequest(f"input[{i}] has {len(ids)} tokens; this model takes at most "
                                         f"{self.max_seq_length} (set truncate_prompt_tokens to cut it)", "input")
                ids = ids[: limit - 1] + ids[-1:] if isinstance(x, str) and limit > 1 else ids[:limit]
            out.append(ids)
        return out

    def embed(self, inputs: list[str | list[int]], truncate: bool | int = False,
              dimensions: int | None = None) -> Embeddings:
        """One vector per input (see the module docstring)."""
        if not inputs:
            raise InvalidRequest("input is empty: give a string, a list of strings or token ids", "input")
        self.check_dimensions(dimensions)
        return self.embed_ids(self.tokenize(inputs, truncate), dimensions)

    def embed_ids(self, ids: list[list[int]], dimensions: int | None = None) -> Embeddings:
        """`embed` for inputs `tokenize` has checked already."""
        out = torch.empty(len(ids), self.dimension, device="cpu")
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        batch: list[int] = []
        for i in order + [None]:
            if batch and (i is None or sum(len(ids[j]) for j in batch) + len(ids[i]) > self.max_batch_tokens):
                out[batch] = self._pass([ids[j] for j in batch])
                batch = []
            if i is not None:
                batch.append(i)
        return Embeddings(self.cut(out, dimensions), [len(x) for x in ids], ids)

    def check_dimensions(self, dimensions: int | None) -> None:
        """`InvalidRequest` unless the vectors can be given with `dimensions` entries."""
        if dimensions is None or dimensions == self.dimension:
            return
        if not self.matryoshka or not 0 < dimensions < self.dimension:
            raise InvalidRequest(f"dimensions={dimensions}: this model gives {self.dimension}-dimensional vectors "
                                 "and was not trained to be cut shorter (no matryoshka_dimensions)", "dimensions")

    def cut(self, vectors: torch.Tensor, dimensions: int | None) -> torch.Tensor:
        """`vectors` cut to their first `dimensions` entries (renormalised when the model
        normalises); unchanged for None or the full size."""
        self.check_dimensions(dimensions)
        if dimensions is None or dimensions == self.dimension:
            return vectors
        out = vectors[:, :dimensions]
        return torch.nn.functional.normalize(out, dim=-1) if self.normalize else out

    def _pass(self, seqs: list[list[int]]) -> torch.Tensor:
        """One packed encoder pass over `seqs`, pooled (and normalised): ``[len(seqs), dim]``."""
        lens = [len(s) for s in seqs]
        dev = self.encoder.device
        hidden = self.encoder(torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=dev), lens).float()
        ends = torch.tensor(lens, device=dev).cumsum(0)
        if self.pooling == "mean":
            pooled = torch.stack([h.mean(0) for h in hidden.split(lens)])
        elif self.pooling == "cls":
            pooled = hidden[ends - torch.tensor(lens, device=dev)]
        else:
            pooled = hidden[ends - 1]
        out = torch.nn.functional.normalize(pooled, dim=-1) if self.normalize else pooled
        return out.cpu()


def score_pairs(a: list, b: list, field: str = "text_1", other: str = "text_2") -> None:
    """Check the two sides of a score request (vLLM's rule): one text against any number, or
    as many as the other side. Raises `InvalidRequest` naming `field`."""
    if not a or not b or (len(a) != 1 and len(a) != len(b)):
        raise InvalidRequest(f"{field} must be one text or as many texts as {other}", field)


def cosine_scores(va: torch.Tensor, vb: torch.Tensor) -> list[float]:
    """The cosine similarity of `va` ``[1 or N, D]`` with each row of `vb` ``[N, D]``: one
    against many, or pair by pair (`score_pairs`)."""
    return torch.nn.functional.cosine_similarity(va.expand(len(vb), -1) if len(va) == 1 else va, vb, dim=-1).tolist()


def _plan_device(device: torch.device | None) -> Device:
    return CPU if device is None or device.type == "cpu" else Device(device, str(device), "asked for")


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not readable JSON ({exc})") from None


def _pooling(path: str) -> tuple[str, bool]:
    """(pooling mode, normalise) from sentence-transformers' ``modules.json`` and pooling config;
    mean pooling without normalisation when the folder has neither."""
    modules = _read_json(os.path.join(path, "modules.json")) or []
    pool_dir = next((m.get("path", "") for m in modules if m.get("type", "").endswith(".Pooling")), "1_Pooling")
    cfg = _read_json(os.path.join(path, pool_dir, "config.json"))
    normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
    if cfg.get("pooling_mode_cls_token"):
        return "cls", normalize
    if cfg.get("pooling_mode_lasttoken"):
        return "last", normalize
    if cfg and not cfg.get("pooling_mode_mean_tokens", True):
        modes = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v]
        raise ModelLoadError(f"{path}: pooling {modes} is not supported; supported: {', '.join(POOLING_MODES)}")
    return "mean", normalize
