"""`ExplainTracer`: records each stage of one generation on the real model, for `nextoken explain`.

What it keeps is plain data (numbers, strings, lists) so it prints in a terminal and serialises
to JSON alike. Tracing runs the reference attention (it needs the attention probabilities).
"""

from __future__ import annotations

import time

import torch

from nextoken.layers.rotary import inv_frequencies


class ExplainTracer:
    """Collects a report of one request. `top` is how many candidates to show per token."""

    def __init__(self, tokenizer, config, top: int = 10):
        self.tok, self.cfg, self.top = tokenizer, config, top
        self.report: dict = {"layers": [], "steps": [], "kv_cache": []}
        self._pass = 0  # forward passes seen (0 = the prefill)
        self._t0 = 0.0
        self._tokens: list[int] = []

    # -- hooks called by the model and the generation loop ---------------------------------
    def on_prefill_start(self, prompt_ids: list[int]) -> None:
        self._tokens = list(prompt_ids)
        self._t0 = time.perf_counter()
        self.report["tokens"] = [{"id": i, "text": self.tok.token_text(i)} for i in prompt_ids]

    def on_embedding(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        if self._pass:
            return
        n = min(len(self._tokens), 4)
        self.report["embedding"] = {
            "matrix_shape": [self.cfg.vocab_size, self.cfg.hidden_size],
            "output_shape": list(h.shape),
            "rows": [{"id": self._tokens[i], "text": self.tok.token_text(self._tokens[i]),
                      "first_values": [round(v, 4) for v in h[i, :6].float().tolist()],
                      "norm": round(float(h[i].float().norm()), 3)} for i in range(n)],
        }
        self.report["rope"] = self._rope(h.shape[0])

    def _rope(self, t: int) -> dict:
        if not self.cfg.rope_dim:  # learned absolute positions (GPT-2)
            return {"positions": [0, t - 1], "rope_dim": 0, "learned_position_embeddings": True}
        inv = inv_frequencies(self.cfg.rope_dim, self.cfg.rope_theta)
        pairs = [0, 1, len(inv) - 1]
        last = t - 1
        return {
            "positions": [0, t - 1], "rope_dim": self.cfg.rope_dim, "base": self.cfg.rope_theta,
            "pairs": [{"pair": i, "radians_per_position": float(inv[i]),
                       "angle_at_last_position": float(last * inv[i])} for i in pairs],
        }

    def on_layer(self, i: int, h: torch.Tensor, probs: list[torch.Tensor] | None) -> None:
        if self._pass or not probs:
            return
        last = probs[0][:, -1, :]  # [heads, seq]: where the last position of the sequence looks
        top_per_head = last.argmax(-1).tolist()
        mean = last.mean(0)
        j = int(mean.argmax())
        self.report["layers"].append({
            "layer": i,
            "residual_norm_last": round(float(h[-1].float().norm()), 3),
            "attends_most": {"position": j, "text": self.tok.token_text(self._tokens[j]),
                             "weight": round(float(mean[j]), 4)},
            "per_head_positions": top_per_head,
        })

    def on_forward_done(self, num_tokens: int, kv_bytes: int) -> None:
        now = time.perf_counter()
        self.report["kv_cache"].append({"tokens": num_tokens, "bytes": kv_bytes,
                                        "seconds": round(now - self._t0, 6)})
        if self._pass == 0:
            self.report["prefill_seconds"] = now - self._t0
        self._pass += 1
        self._t0 = now

    def on_sample(self, logits: torch.Tensor, res, params) -> None:
        probs = logits.float().softmax(-1)
        vals, ids = logits.topk(self.top)
        cands = []
        for v, t in zip(vals.tolist(), ids.tolist()):
            cands.append({"id": t, "text": self.tok.token_text(t), "logit": round(v, 3),
                          "prob": round(float(probs[t]), 5),
                          "kept": bool(res.kept[t]) if res.kept is not None else None,
                          "sample_prob": round(float(res.probs[t]), 5) if res.probs is not None else None})
        kept_n = int(res.kept.sum()) if res.kept is not None else None
        self.report["steps"].append({"chosen": {"id": res.token, "text": self.tok.token_text(res.token)},
                                     "candidates": cands, "kept_count": kept_n})
        self._tokens.append(res.token)


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
