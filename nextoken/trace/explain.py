"""`nextoken explain`: one generation's stages on the real model, from the request's
`TraceRecorder` (`trace.recorder`), rendered two ways: `explain_report` (plain data: numbers,
strings, lists; what ``--json`` prints) and `format_report` (the same, as text for a terminal).
Tracing runs the reference attention (it needs the attention probabilities).
"""

from __future__ import annotations

from nextoken.layers.rotary import inv_frequencies
from nextoken.trace.recorder import TraceRecorder


def recorder_for(config) -> TraceRecorder:
    """The recorder `explain` needs: each layer's attention from the prompt's last position only."""
    return TraceRecorder(config, last_row_only=True)


def explain_report(rec: TraceRecorder, tok, cfg, top: int = 10) -> dict:
    """The report of a recorded request: its tokens, the embedding, RoPE, each layer (residual
    norm and where the last position attends), each sampled token's `top` candidates, the KV
    cache after each pass and the prefill's time."""
    ids = rec.token_ids
    t = len(ids)
    emb = rec.residual[0]
    report = {"tokens": [{"id": i, "text": tok.token_text(i)} for i in ids]}
    report["embedding"] = {
        "matrix_shape": [cfg.vocab_size, cfg.hidden_size], "output_shape": [t, cfg.hidden_size],
        "rows": [{"id": ids[i], "text": tok.token_text(ids[i]),
                  "first_values": [round(v, 4) for v in emb[i, :6].tolist()], "norm": round(float(emb[i].norm()), 3)}
                 for i in range(min(t, 4))]}
    report["rope"] = _rope(cfg, t)
    report["layers"] = [_layer(rec, tok, i) for i in range(cfg.num_layers)] if rec.attention else []
    report["steps"] = [{"chosen": {"id": s["chosen"], "text": tok.token_text(s["chosen"])},
                        "candidates": [{"id": c["id"], "text": tok.token_text(c["id"]), "logit": round(c["logit"], 3),
                                        "prob": round(c["prob"], 5), "kept": c["kept"],
                                        "sample_prob": None if c["sample_prob"] is None else round(c["sample_prob"], 5)}
                                       for c in s["candidates"][:top]],
                        "kept_count": s["kept_count"]} for s in rec.steps]
    report["kv_cache"] = [{"tokens": p["cached_tokens"], "bytes": p["kv_bytes"], "seconds": round(p["ms"] / 1000, 6)}
                          for p in rec.passes]
    prompt_passes = [p for p in rec.passes if p["tokens"]]
    report["prefill_seconds"] = sum(p["ms"] for p in prompt_passes) / 1000
    return report


def _layer(rec: TraceRecorder, tok, i: int) -> dict:
    last = rec.last_row(i)  # [heads, T]: where the last position of the prompt looks
    mean = last.mean(0)
    j = int(mean.argmax())
    return {"layer": i, "residual_norm_last": round(float(rec.residual[i + 1, -1].norm()), 3),
            "attends_most": {"position": j, "text": tok.token_text(rec.token_ids[j]),
                             "weight": round(float(mean[j]), 4)},
            "per_head_positions": last.argmax(-1).tolist()}


def _rope(cfg, t: int) -> dict:
    if not cfg.rope_dim:  # learned absolute positions (GPT-2)
        return {"positions": [0, t - 1], "rope_dim": 0, "learned_position_embeddings": True}
    inv = inv_frequencies(cfg.rope_dim, cfg.rope_theta)
    return {"positions": [0, t - 1], "rope_dim": cfg.rope_dim, "base": cfg.rope_theta,
            "pairs": [{"pair": i, "radians_per_position": float(inv[i]),
                       "angle_at_last_position": float((t - 1) * inv[i])}
                      for i in (0, 1, len(inv) - 1)]}


def format_report(r: dict, prompt: str, rendered: str | None, cfg, params, total_s: float) -> str:
    """The report as text for a terminal, stage by stage."""
    out = []
    add = out.append
    add("== 1. Text ==")
    add(repr(prompt))
    add("\n== 2. Chat template ==")
    add(rendered if rendered is not None else "(raw prompt: no template applied)")
    add(f"\n== 3. Tokens (byte-level BPE): {len(r['tokens'])} ==")
    add("  ".join(f"{t['id']}:{t['text']!r}" for t in r["tokens"]))
    e = r["embedding"]
    add("\n== 4. Embedding ==")
    add(f"The embedding matrix is [{e['matrix_shape'][0]} tokens x {e['matrix_shape'][1]} dims]; "
        f"looking up the {len(r['tokens'])} ids gives a [{e['output_shape'][0]} x {e['output_shape'][1]}] matrix.")
    for row in e["rows"]:
        add(f"  id {row['id']:>6} {row['text']!r:<14} -> [{', '.join(f'{v:+.4f}' for v in row['first_values'])}, ...]"
            f"  |x| = {row['norm']}")
    p = r["rope"]
    add("\n== 5. Positions and RoPE ==")
    add(f"Positions 0..{p['positions'][1]}. RoPE rotates each of the {p['rope_dim'] // 2} pairs of dims of every "
        f"query and key head by position x base^(-2i/{p['rope_dim']}) (base {p['base']:g}),")
    add("so a query-key dot product depends only on how far apart the two tokens are. At the last position:")
    for q in p["pairs"]:
        add(f"  pair {q['pair']:>2}: {q['radians_per_position']:.6f} rad/position -> "
            f"{q['angle_at_last_position']:.3f} rad")
    add(f"\n== 6. Transformer layers ({cfg.num_layers}): norm -> attention (GQA {cfg.num_heads} query / "
        f"{cfg.num_kv_heads} KV heads) -> residual -> norm -> SwiGLU MLP -> residual ==")
    add("layer  |residual| at last pos   last position attends most to (mean over heads)   per-head argmax positions")
    for L in r["layers"]:
        a = L["attends_most"]
        add(f"  {L['layer']:>3}  {L['residual_norm_last']:>10.3f}            pos {a['position']:>4} {a['text']!r:<14} "
            f"w={a['weight']:.3f}      {L['per_head_positions']}")
    add(f"\n== 7. Logits -> softmax -> sampling ({_describe(params)}) ==")
    for k, s in enumerate(r["steps"]):
        kept = f", {s['kept_count']} candidates kept" if s["kept_count"] is not None else ""
        add(f"token {k + 1}: chose {s['chosen']['id']} {s['chosen']['text']!r}{kept}")
        for c in s["candidates"]:
            mark = "*" if c["id"] == s["chosen"]["id"] else " "
            kept_s = "" if c["kept"] is None else ("kept" if c["kept"] else "cut")
            add(f"   {mark} {c['id']:>6} {c['text']!r:<16} logit {c['logit']:>8.3f}  p {c['prob']:.4f}  {kept_s}")
    add("\n== 8. KV cache and time ==")
    for kv in r["kv_cache"]:
        add(f"  after {kv['tokens']:>4} tokens: {kv['bytes']:>10,} bytes   (pass took {kv['seconds'] * 1000:.1f} ms)")
    add(f"prefill {r.get('prefill_seconds', 0) * 1000:.1f} ms for {len(r['tokens'])} tokens; total {total_s:.2f} s "
        "(tracing uses the reference attention and is slower than `run`)")
    return "\n".join(out)


def _describe(params) -> str:
    if params.greedy:
        return "greedy: always the most likely token"
    parts = [f"temperature {params.temperature}"]
    if params.top_k > 0:
        parts.append(f"top-k {params.top_k}")
    if params.top_p < 1:
        parts.append(f"top-p {params.top_p}")
    if params.min_p > 0:
        parts.append(f"min-p {params.min_p}")
    return ", ".join(parts)
