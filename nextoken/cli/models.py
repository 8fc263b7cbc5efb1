"""``nextoken pull``, ``models``, ``bench`` and ``embed``: the catalog, measuring a model, embeddings."""

from __future__ import annotations

from nextoken.cli.common import engine_args


def cmd_pull(a) -> int:
    from nextoken.catalog import pull

    path = pull(a.name, force=a.force)
    print(path)
    return 0


def cmd_models(a) -> int:
    from nextoken.catalog import cache_dir, list_models

    print(f"{'NAME':<30} {'ARCH':<7} {'SIZE':>9}  {'CACHED':<6} DESCRIPTION")
    for m in list_models():
        print(f"{m['name']:<30} {m['architecture']:<7} {m['size'] / 2**20:>7.1f}Mi  {'yes' if m['cached'] else 'no':<6} "
              f"{m['description']}")
    print(f"cache: {cache_dir()}")
    return 0


def cmd_bench(a) -> int:
    from nextoken.bench import run

    return run(a, engine_args(a))


def cmd_embed(a) -> int:
    """``nextoken embed TEXT...``: each text's embedding (its first values and length), and the
    cosine similarity of every pair; with ``--json``, the vectors in OpenAI's shape."""
    import json

    from nextoken import LLM

    llm = LLM(a.model, dtype=a.dtype, quantization=a.quantization)
    outs = llm.embed(a.texts, truncate=a.truncate, dimensions=a.dimensions)
    if a.json:
        print(json.dumps({"object": "list", "model": a.model,
                          "data": [{"object": "embedding", "index": i, "embedding": o.outputs.embedding}
                                   for i, o in enumerate(outs)]}))
        return 0
    vecs = [o.outputs.embedding for o in outs]
    for text, o, v in zip(a.texts, outs, vecs):
        norm = sum(x * x for x in v) ** 0.5
        head = ", ".join(f"{x:+.4f}" for x in v[:6])
        print(f"{text[:40]!r:<44} {len(o.prompt_token_ids):>4} tokens  [{head}, ...] dim {len(v)}, norm {norm:.4f}")
    if len(vecs) > 1:
        print("cosine similarity:")
        for i in range(len(vecs)):
            for j in range(i + 1, len(vecs)):
                dot = sum(x * y for x, y in zip(vecs[i], vecs[j]))
                n = (sum(x * x for x in vecs[i]) * sum(y * y for y in vecs[j])) ** 0.5
                print(f"  {i} ~ {j}: {dot / n:.4f}")
    return 0
