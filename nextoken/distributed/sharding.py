"""Which rows or columns of each weight a tensor-parallel rank holds.

An architecture names how its projections split in ``TP_PLAN`` (the vocabulary of
`transformers`' ``base_model_tp_plan``): ``colwise`` cuts the output features (the weight's
rows: q/k/v by heads, gate/up by feed-forward columns), so each rank computes its heads or
columns alone; ``rowwise`` cuts the input features (the weight's columns: o by heads, down by
feed-forward columns) and the ranks' partial products are summed by an all-reduce. Per layer
that is one all-reduce after attention and one after the MLP (Megatron-LM, Shoeybi et al. 2019,
section 3). The embedding table and the LM head are cut by vocabulary rows: the embedding's
lookups are summed by an all-reduce (a rank contributes only the ids in its slice), the head's
logit columns are gathered.

Bounds: the key/value heads (and the query heads) must divide evenly; feed-forward columns are
cut on 256-column boundaries where they can be (a K-quant's block: the shard keeps its codes
and our kernel), possibly unevenly; a column cut that falls inside a quantization block makes
that shard dense (the loader de-quantizes it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nextoken.config import ModelConfig
from nextoken.errors import InvalidRequest

FFN_ALIGN = (256, 32, 1)  # feed-forward cut boundaries, tried in order (K-quant, legacy block, any)

Range = tuple[int, int]


@dataclass(frozen=True)
class Partition:
    """One rank's query heads, key/value heads, feed-forward columns and vocabulary rows (each
    ``[start, stop)``), and every rank's vocabulary width (for the head's gather)."""

    heads: Range
    kv_heads: Range
    ffn: Range
    vocab: Range
    vocab_widths: tuple[int, ...]


def _split(n: int, size: int, rank: int) -> Range:
    """``[start, stop)`` of part `rank` when `n` units are cut into `size` parts (the first
    ``n % size`` parts one unit larger)."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def valid_sizes(cfg: ModelConfig) -> list[int]:
    """The tensor-parallel sizes `cfg` can be split into (divisors of its key/value heads that
    also divide its query heads)."""
    return [n for n in range(1, cfg.num_kv_heads + 1) if cfg.num_kv_heads % n == 0 and cfg.num_heads % n == 0]


def partition(cfg: ModelConfig, rank: int, size: int) -> Partition:
    """Rank `rank`'s part of `cfg`. Raises `InvalidRequest` when the heads do not split `size`
    ways, naming the sizes that do."""
    if cfg.num_kv_heads % size or cfg.num_heads % size:
        raise InvalidRequest(f"{cfg.name} has {cfg.num_heads} query and {cfg.num_kv_heads} key/value heads, which "
                             f"do not split {size} ways; its tensor-parallel size can be "
                             f"{' or '.join(map(str, valid_sizes(cfg)))}", "tensor_parallel_size")
    align = next(a for a in FFN_ALIGN if cfg.intermediate_size % a == 0 and cfg.intermediate_size // a >= size)
    f0, f1 = _split(cfg.intermediate_size // align, size, rank)
    widths = tuple(b - a for a, b in (_split(cfg.vocab_size, size, r) for r in range(size)))
    return Partition(_split(cfg.num_heads, size, rank), _split(cfg.num_kv_heads, size, rank),
                     (f0 * align, f1 * align), _split(cfg.vocab_size, size, rank), widths)


def shard_config(cfg: ModelConfig, part: Partition) -> ModelConfig:
    """The configuration of one rank's model: its heads, feed-forward width and vocabulary
    slice (the hidden size, layers and head size stay)."""
    width = lambda r: r[1] - r[0]  # noqa: E731
    return dataclasses.replace(cfg, num_heads=width(part.heads), num_kv_heads=width(part.kv_heads),
                               intermediate_size=width(part.ffn), vocab_size=width(part.vocab))


def parallelize(model, cfg: ModelConfig, part: Partition, tp) -> dict[str, tuple[int, int, int]]:
    """Make `model` (built from `shard_config`) one rank of the group `tp`: its row-parallel
    projections all-reduce their outputs, its embedding reads only its vocabulary slice and
    all-reduces, its head gathers the vocabulary. Returns, per parameter name, the slice of the
    checkpoint tensor this rank loads: ``(dim, start, stop)``. Raises `InvalidRequest` for an
    architecture without a ``TP_PLAN``."""
    plan = getattr(type(model), "TP_PLAN", None)
    if not plan:
        raise InvalidRequest(f"the {cfg.architecture} architecture has no tensor-parallel plan; run it with "
                             "--tensor-parallel-size 1", "tensor_parallel_size")
    units = {"heads": (part.heads, cfg.head_dim), "kv_heads": (part.kv_heads, cfg.head_dim), "ffn": (part.ffn, 1)}
    shards = {}
    for i, layer in enumerate(model.layers):
        for name, (style, unit) in plan.items():
            (lo, hi), scale = units[unit]
            linear, param = layer.get_submodule(name), f"layers.{i}.{name}"
            if style == "colwise":
                shards[param + ".weight"] = (0, lo * scale, hi * scale)
                if linear.bias is not None:
                    shards[param + ".bias"] = (0, lo * scale, hi * scale)
            else:  # rowwise: partial products, summed over the ranks
                if linear.bias is not None:
                    raise InvalidRequest(f"{param} has a bias, which a row-parallel split does not support",
                                         "tensor_parallel_size")
                shards[param + ".weight"] = (1, lo * scale, hi * scale)
                linear.combine = tp.all_reduce
    v0, v1 = part.vocab
    shards["embed_tokens.weight"] = (0, v0, v1)
    model.embed_tokens.vocab_start, model.embed_tokens.combine = v0, tp.all_reduce
    if not cfg.tie_word_embeddings:
        shards["lm_head.weight"] = (0, v0, v1)
    model.lm_head.combine = lambda logits: tp.all_gather_columns(logits, list(part.vocab_widths))
    return shards
