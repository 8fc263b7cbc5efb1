"""The inspector's numbers (`nextoken.inspect`), against independent oracles: `transformers`'
attention weights, hidden states and rotary tables on the tiny models, the `gguf` package's own
de-quantization of SmolLM2's embedding table, the engine's own generations and beam search, and
the KV cache's tensors. The HTTP routes are exercised on a live server."""

from __future__ import annotations

import json
import time

import httpx
import numpy as np
import pytest
import torch

from nextoken import LLM, SamplingParams
from nextoken.engine.view import EngineView
from nextoken.inspect import engine_view, model_view, text
from nextoken.inspect.trace import MAX_TRACE_TOKENS, head_stats, logit_lens
from nextoken.trace.recorder import TraceRecorder
from tests.helpers.server import LiveServer

PROMPT_IDS = [3, 17, 42, 7, 99, 5, 61, 23, 11, 80, 4, 33]


def traced(llm: LLM, ids: list[int]) -> TraceRecorder:
    tracer = TraceRecorder(llm.config)
    for _ in llm.stream(ids, SamplingParams(temperature=0, max_tokens=1), tracer=tracer):
        pass
    return tracer


@pytest.fixture(scope="module")
def tiny_llms(tiny_gguf):
    return {arch: LLM(str(path), dtype="float32") for arch, (path, _) in tiny_gguf.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_attention_and_residuals_equal_transformers(tiny_gguf, tiny_llms, arch):
    """Every layer's and head's weights equal `transformers`' (eager attention, output_attentions),
    rows sum to 1 and are zero above the diagonal (and outside the window of sliding layers); the
    residual stream inside each layer, after attention's add, equals what transformers feeds the
    norm before its feed-forward; the logit lens at the last layer equals transformers'
    next-token distribution."""
    llm, hf = tiny_llms[arch], tiny_gguf[arch][1]
    tracer = traced(llm, PROMPT_IDS)
    mids = []
    norm = "pre_feedforward_layernorm" if arch == "gemma3" else "post_attention_layernorm"
    hooks = [getattr(layer, norm).register_forward_pre_hook(lambda m, args: mids.append(args[0][0].clone()))
             for layer in hf.model.layers]
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT_IDS]), output_attentions=True)
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(tracer.mid, torch.stack(mids), atol=1e-4, rtol=1e-4)
    cfg = llm.config
    assert len(tracer.attention) == cfg.num_layers == len(ref.attentions)
    t = len(PROMPT_IDS)
    for layer, (ours, theirs) in enumerate(zip(tracer.attention, ref.attentions)):
        assert ours.shape == (cfg.num_heads, t, t)
        ours = ours.float()
        torch.testing.assert_close(ours, theirs[0], atol=1e-3, rtol=0)
        torch.testing.assert_close(ours.sum(-1), torch.ones(cfg.num_heads, t), atol=5e-3, rtol=0)
        assert (ours.triu(1) == 0).all()
        if cfg.is_sliding(layer):
            q, k = torch.meshgrid(torch.arange(t), torch.arange(t), indexing="ij")
            assert (ours[:, q - k >= cfg.sliding_window] == 0).all()
        assert len(head_stats(tracer, layer)) == cfg.num_heads
    lens = logit_lens(tracer, llm.runner.model, llm.tokenizer, t - 1, top=3)
    assert len(lens) == cfg.num_layers + 1
    want = ref.logits[0, -1].softmax(-1)
    top = want.topk(3)
    assert [e["id"] for e in lens[-1]["top"]] == top.indices.tolist()
    assert [e["prob"] for e in lens[-1]["top"]] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_head_labels_follow_the_stated_rule(tiny_llms):
    tracer = traced(tiny_llms["llama"], PROMPT_IDS)
    t = len(PROMPT_IDS)
    prev = torch.zeros(1, t, t, dtype=torch.float16)
    prev[0, 0, 0] = 1
    prev[0, torch.arange(1, t), torch.arange(t - 1)] = 1
    uniform = torch.tril(torch.ones(t, t)) / torch.arange(1, t + 1)[:, None]
    first = torch.zeros(1, t, t, dtype=torch.float16)
    first[0, :, 0] = 1
    tracer.attention[0] = torch.cat([prev, first, torch.eye(t)[None].half(), uniform[None].half()])
    labels = [h["label"] for h in head_stats(tracer, 0)]
    assert labels == ["previous token", "first token (sink)", "self", "broad"]


def test_rope_tables_equal_transformers(tiny_gguf, tiny_llms):
    """The angles and cos table shown are the model's, and equal transformers' rotary embedding."""
    llm, hf = tiny_llms["llama"], tiny_gguf["llama"][1]
    r = model_view.rope_view(llm.runner.model, 32)
    pos = torch.arange(32)
    cos, _ = hf.model.rotary_emb(torch.zeros(1, 32, 16), pos[None])
    pairs = r["pairs"]
    np.testing.assert_allclose(np.array(r["cos"]), cos[0, :, :pairs].numpy(), atol=1e-4)
    np.testing.assert_allclose(np.cos(np.array(r["angle"])), cos[0, :, :pairs].numpy(), atol=2e-4)
    assert r["decay"]["score"][0] == pytest.approx(1.0)
    g = model_view.rope_view(tiny_llms["gemma3"].runner.model, 16)
    assert "cos" in g


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_kv_bytes_formula_equals_the_cache(tiny_llms, arch):
    eng = tiny_llms[arch].engine
    v = engine_view.kv_view(EngineView(eng))
    kv = eng.runner.kv
    assert v["bytes_per_token"] == v["measured_bytes_per_token"] == (kv.k.nbytes + kv.v.nbytes) // (
        kv.num_blocks * kv.block_size)
    if arch == "gemma3":
        assert v["sliding"]["layers"] == 5 and v["sliding"]["bytes_per_token"] > 0


def test_bpe_replay_ends_at_the_tokenizer_ids(smol_llm):
    tok = smol_llm.tokenizer
    for word in [" tokenization", " unbelievable", "artificial", " intelligence", "12345", " naïve", "日本"]:
        r = text.bpe_replay(tok, word)
        assert r["ids"] == r["tokenizer_ids"], word
        for p in r["pieces"]:
            if p["steps"]:
                assert "".join(p["steps"][-1]["symbols"]) == p["piece"]


def test_tokens_view_marks_special_and_partial_tokens(smol_llm):
    r = text.tokens_view(smol_llm.tokenizer, "hi 😀", chat=True)
    assert r["tokens"][0]["special"] and r["rendered"].startswith("<|im_start|>")
    partial = [t for t in r["tokens"] if t["partial_utf8"]]
    assert partial and b"".join(bytes.fromhex(t["bytes"]) for t in partial[-2:]).endswith("😀".encode()[-1:])
    whole = b"".join(bytes.fromhex(t["bytes"]) for t in r["tokens"])
    assert whole.decode() == r["rendered"]


def test_analogy_is_exact_on_the_stored_table(smol_llm, smollm2_path):
    """The vector is E[king] - E[man] + E[woman] of the table the `gguf` package de-quantizes
    itself, and the nearest tokens and the rank of ' queen' agree with a plain computation."""
    import gguf

    from tests.helpers.gguf_reader import plain_arrays

    with plain_arrays():
        reader = gguf.GGUFReader(str(smollm2_path))
    t = next(t for t in reader.tensors if t.name == "token_embd.weight")
    table = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    r = text.analogy(smol_llm.runner.model, smol_llm.tokenizer, "king", "man", "woman", "queen")
    ids = r["ids"]
    v = table[ids["a"]] - table[ids["b"]] + table[ids["c"]]
    np.testing.assert_allclose(r["vector"], v.numpy(), atol=2e-6)
    cos = torch.nn.functional.cosine_similarity(table, v[None], dim=-1)
    cos[[ids["a"], ids["b"], ids["c"]]] = -2
    assert [n["id"] for n in r["nearest"][:5]] == cos.topk(5).indices.tolist()
    assert r["target"]["rank"] == int((cos > cos[ids["target"]]).sum()) + 1


def test_embedding_map_projects_the_rows(smol_llm):
    words = ["king", "queen", "cat", "dog", "Paris"]
    r = text.embedding_map(smol_llm.runner.model, smol_llm.tokenizer, words)
    x = text.embedding_rows(smol_llm.runner.model, [p["id"] for p in r["points"]])
    xc = x - x.mean(0)
    # the projection keeps the pairwise distances of the two leading components: its Gram matrix
    # is the best rank-2 approximation of the centred rows' Gram matrix
    pts = torch.tensor([[p["x"], p["y"]] for p in r["points"]])
    u, s, _ = torch.linalg.svd(xc, full_matrices=False)
    torch.testing.assert_close(pts @ pts.T, (u[:, :2] * s[:2]) @ (u[:, :2] * s[:2]).T, atol=1e-3, rtol=1e-3)
    with pytest.raises(Exception, match="not a single token"):
        text.embedding_map(smol_llm.runner.model, smol_llm.tokenizer, ["king", "queen", "xqzwvjk"])


def test_requant_error_and_formats(smollm2_path):
    s = model_view.stored_tensors(str(smollm2_path))
    assert sum(b["bytes"] for b in s["formats"].values()) == sum(t["bytes"] for t in s["tensors"])
    r = model_view.requant_error(str(smollm2_path), "blk.0.attn_q.weight")
    by = {q["format"]: q for q in r["requantized"]}
    assert r["stored_type"] == "Q4_1" and by["Q4_1"]["rms_error"] < 1e-6  # its own format: a round trip
    assert by["Q8_0"]["rms_error"] < by["Q5_0"]["rms_error"] < by["Q4_0"]["rms_error"]


# -- through the server ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_llm(smollm2_path):
    return LLM(str(smollm2_path))


@pytest.fixture(scope="module")
def oracle(smollm2_llm):
    """A second engine on the same model, for the comparisons: the served engine is stepped by
    the server's loop thread and must not be driven from the test's thread at the same time."""
    return smollm2_llm


@pytest.fixture(scope="module")
def srv(smol_llm):
    s = LiveServer(smol_llm, "smollm2")
    yield s
    s.stop()


def post(srv, path, body, **kw):
    return httpx.post(f"{srv.url}/inspect/api/{path}", json=body, timeout=120, **kw)


def test_sampling_playground_draws_what_the_engine_generates(srv, oracle):
    prompt = "It was a beautiful"
    settings = dict(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.3)
    for seed in range(8):
        r = post(srv, "sample", {"prompt": prompt, "seed": seed, **settings})
        assert r.status_code == 200, r.text
        view = r.json()
        out = oracle.generate(prompt, SamplingParams(max_tokens=1, seed=seed, **settings))[0]
        assert view["chosen"]["id"] == out.outputs[0].token_ids[0]
        k = view["kept_counts"]
        assert k["min_p"] <= k["top_p"] <= k["top_k"] <= 40
        finals = [c["p_final"] for c in view["candidates"] if c["kept"]["min_p"]]
        assert sum(finals) == pytest.approx(1.0, abs=2e-3)
    g = post(srv, "sample", {"prompt": prompt, "temperature": 0}).json()
    greedy = oracle.generate(prompt, SamplingParams(max_tokens=1, temperature=0))[0]
    assert g["chosen"]["id"] == greedy.outputs[0].token_ids[0] and g["kept_counts"]["min_p"] == 1


def test_grammar_mask_stage_refuses_what_the_grammar_refuses(srv, oracle):
    """Under a regex the sampling view's grammar stage keeps exactly llguidance's own allowed
    tokens (`reference_allowed`, its byte-per-token bias), marks refused candidates, and draws
    what a request with that regex draws: greedy, and seeded step by step."""
    from nextoken.structured import StructuredOutputsParams
    from nextoken.structured.backend import reference_allowed

    prompt, regex = "The year it happened was", "(19|20)[0-9]{2}"
    so = StructuredOutputsParams(regex=regex)
    compiled = oracle.engine.grammars.compile(so)
    want_allowed = int(reference_allowed(compiled.deep_copy(), oracle.config.vocab_size).sum())
    for settings in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}, {"temperature": 0.7, "seed": 11}):
        want = oracle.generate(prompt, SamplingParams(max_tokens=3, structured_outputs=so, **settings))[0]
        generated = []
        for step, token in enumerate(want.outputs[0].token_ids):
            r = post(srv, "sample", {"prompt": prompt, "regex": regex, "generated": generated, **settings})
            assert r.status_code == 200, r.text
            view = r.json()
            assert view["grammar"] and view["chosen"]["id"] == token
            if step == 0:
                assert view["kept_counts"]["grammar"] == want_allowed
                refused = [c for c in view["candidates"] if not c["kept"]["grammar"]]
                assert refused and all(c["p_final"] == 0 and not c["kept"]["min_p"] for c in refused)
                assert all(oracle.tokenizer.token_text(c["id"]).strip()[:2] in ("19", "20", "1", "2")
                           for c in view["candidates"] if c["kept"]["grammar"])
            if not settings.get("seed"):  # the seed's stream restarts each call: only the first draw is a request's
                generated.append(token)
            else:
                break
    assert post(srv, "sample", {"prompt": prompt, "regex": regex, "generated": [oracle.tokenizer.encode("x")[0]]}
                ).status_code == 400
    bad = post(srv, "sample", {"prompt": prompt, "regex": "a", "json_schema": {"type": "object"}})
    assert bad.status_code == 400 and "not both" in bad.json()["error"]["message"]
    schema = post(srv, "sample", {"prompt": prompt, "json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
                                  "temperature": 0})
    assert schema.status_code == 200 and schema.json()["chosen"]["token"] == "{"


def test_quantization_cost_against_the_float32_path(srv, oracle, smollm2_f32):
    """The KL view's reference side equals the float32 plain path's prompt log-probabilities (the
    path test_real_model holds to `transformers`' logits within 5e-5; `transformers`' own load
    of this GGUF costs 25 s) for each next token and the top token; its served side equals the
    served engine's own prompt log-probabilities; the KL is a divergence (>= 0, its mean the
    mean)."""
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"
    r = post(srv, "quant/kl", {"prompt": prompt})
    assert r.status_code == 200, r.text
    view = r.json()
    ids = oracle.tokenizer.encode(prompt)
    rows = view["positions"]
    assert len(rows) == len(ids) - 1 == view["prompt_tokens"] - 1
    ref = smollm2_f32.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=3))[0].prompt_logprobs[1:]
    assert [x["logprob_reference"] for x in rows] == pytest.approx([lp[t] for lp, t in zip(ref, ids[1:])], abs=1e-4)
    assert [x["top_reference"] for x in rows] == [text.display(oracle.tokenizer.token_text(max(lp, key=lp.get)))
                                                  for lp in ref]
    served = oracle.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    assert [x["logprob_served"] for x in rows] == pytest.approx([served[p + 1][ids[p + 1]] for p in range(len(ids) - 1)],
                                                                abs=2e-3)
    kls = [x["kl"] for x in rows]
    assert min(kls) >= -1e-6 and view["kl_mean"] == pytest.approx(sum(kls) / len(kls), abs=1e-5)
    assert view["top1_agreement"] == pytest.approx(sum(x["same_top"] for x in rows) / len(rows), abs=1e-4)
    assert view["reference"]["bytes"] < view["reference"]["cap_bytes"]
    assert post(srv, "quant/kl", {"prompt": "a"}).status_code == 400  # one token: nothing to score
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:  # the reference engine is stepped by one request at a time
        both = list(pool.map(lambda p: post(srv, "quant/kl", {"prompt": p}), ["Hello world, a test.", "Once upon a time",
                                                                              "The sky is blue"]))
    assert [r.status_code for r in both] == [200, 200, 200], [r.text for r in both]


def test_speculation_on_demand_gives_greedy_text_and_accepts_repeats(srv, oracle):
    """N-gram speculation for one request on a server without --speculative-*: greedy, the
    emitted tokens are greedy generate's; a repetitive prompt gets drafts accepted, every
    verification emits its accepted drafts plus one token, and greedy p_target is 1 exactly for
    the accepted ones."""
    prompt = "one two three four five, one two three four five, one two"
    r = post(srv, "spec/run", {"prompt": prompt, "max_tokens": 16, "num_speculative_tokens": 4})
    assert r.status_code == 200, r.text
    view = r.json()
    want = oracle.generate(prompt, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].token_ids
    assert view["token_ids"] == want
    assert view["accepted"] > 0 and 0 < view["verifications"] <= view["target_passes"] == len(view["steps"]) < 16
    for st in view["steps"]:
        assert len(st["emitted"]) == st["accepted"] + 1 or st is view["steps"][-1]
        assert [e["id"] for e in st["emitted"][: st["accepted"]]] == [d["id"] for d in st["drafted"][: st["accepted"]]]
        assert st["p_target"][: st["accepted"]] == [1.0] * st["accepted"]
        if len(st["p_target"]) > st["accepted"]:
            assert st["p_target"][st["accepted"]] == 0.0
    sampled = post(srv, "spec/run", {"prompt": prompt, "max_tokens": 8, "temperature": 0.8, "seed": 5}).json()
    assert len(sampled["token_ids"]) == 8 and all(0 <= p <= 1 for st in sampled["steps"] for p in st["p_target"])


def test_speculation_in_the_engine_reads_its_own_verifications(smollm2_path, oracle, srv):
    """On a server started with --speculative-method ngram, method "engine" runs an ordinary
    request and shows the engine's own verifications of it: the tokens are greedy generate's,
    each verification's emitted tokens are its accepted drafts plus one, and every token is in a
    verification, a plain decode step or the prefill. Without speculation the method is refused."""
    prompt = "one two three four five, one two three four five, one two"
    spec_srv = LiveServer(LLM(str(smollm2_path), speculative_method="ngram"), "smollm2")
    try:
        r = httpx.post(f"{spec_srv.url}/inspect/api/spec/run", json={"method": "engine", "prompt": prompt,
                                                                     "max_tokens": 16}, timeout=120)
    finally:
        spec_srv.stop()
    assert r.status_code == 200, r.text
    view = r.json()
    assert view["token_ids"] == oracle.generate(prompt, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].token_ids
    assert view["method"] == "ngram" and view["verifications"] > 0 and view["accepted"] > 0
    for st in view["steps"]:
        assert [e["id"] for e in st["emitted"][: st["accepted"]]] == [d["id"] for d in st["drafted"][: st["accepted"]]]
        assert len(st["emitted"]) == st["accepted"] + 1
    assert view["target_passes"] < 16
    refused = post(srv, "spec/run", {"method": "engine", "prompt": prompt})
    assert refused.status_code == 400 and "without speculative decoding" in refused.json()["error"]["message"]


def test_journey_steps_equal_greedy_generate_and_show_each_stage(srv, oracle):
    """Five journey steps, each fed the tokens chosen so far, give greedy `LLM.generate`'s ids;
    every stage carries this prompt's data; a seeded step draws what a seeded request draws."""
    prompt = "The capital of France is"
    ids = oracle.tokenizer.encode(prompt)
    want = oracle.generate(ids, SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].token_ids
    generated = []
    for step in range(5):
        r = post(srv, "journey/step", {"prompt": prompt, "generated": generated})
        assert r.status_code == 200, r.text
        v = r.json()
        n = len(ids) + step
        assert [t["id"] for t in v["tokens"]] == ids + generated and v["prompt_tokens"] == len(ids)
        assert len(v["layers"]) == 30 and all(len(layer["heads"]) == 9 for layer in v["layers"])
        for layer in v["layers"]:  # the last query row's three strongest keys, all at or before it
            assert all(0 <= k["position"] < n for head in layer["heads"] for k in head)
        for a, b in zip(v["layers"], v["layers"][1:]):  # one residual stream: each layer starts where the last ended
            assert b["norm_in"] == a["norm_out"] and a["norm_mid"] > 0
        assert v["positions"]["position"] == n - 1 and v["positions"]["pairs"][0]["rate"] == pytest.approx(1.0)
        assert sum(v["kv"]["blocks"]) == n and v["embedding"]["id"] == (ids + generated)[-1]
        assert v["final"]["top"][0]["id"] == v["choice"]["id"]  # greedy: the largest logit
        assert v["layers"][-1]["lens"]["id"] == v["choice"]["id"]  # the last layer's lens is the output
        c = v["commitment"]  # greedy: the lens ends at the chosen token; from `top1` on it stays there
        assert c["layers"] == 30 and len(c["ranks"]) == 30 and c["ranks"][-1] == 0
        assert c["top1"] is not None and c["top3"] is not None and c["top3"] <= c["top1"]
        assert all(r == 0 for r in c["ranks"][c["top1"]:]) and (c["top1"] == 0 or c["ranks"][c["top1"] - 1] > 0)
        for layer in v["layers"]:  # the layers' lens column agrees: top-1 exactly where the rank is 0
            assert (layer["lens"]["id"] == v["choice"]["id"]) == (c["ranks"][layer["layer"]] == 0)
        generated.append(v["choice"]["id"])
    assert generated == want
    assert v["detokenizer"]["after"] == oracle.tokenizer.decode(want)  # the text after the fifth token
    settings = dict(temperature=0.9, top_k=40, seed=3)
    seeded = post(srv, "journey/step", {"prompt": prompt, **settings}).json()
    out = oracle.generate(prompt, SamplingParams(max_tokens=1, **settings))[0]
    assert seeded["choice"]["id"] == out.outputs[0].token_ids[0]


def test_branch_alternatives_and_trajectories_equal_fresh_requests(srv, oracle):
    """A branch point of a greedy journey: the chosen token first (probability 1 after greedy's
    chain), the other alternatives by raw probability, each preview the greedy continuation a
    fresh request forcing that token generates; a trajectory from an alternative equals a fresh
    request forcing the same prefix, greedy and seeded alike, and reports the prompt tokens the
    engine served from its prefix cache (whole blocks of the shared prefix, and the part-filled
    block an earlier request with the same tokens left)."""
    prompt = "Here is a list of the largest cities in Europe, ordered by population, with a short note:"
    ids = oracle.tokenizer.encode(prompt)
    greedy = oracle.generate(ids, SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids
    generated = list(greedy[:2])
    r = post(srv, "journey/branch", {"prompt": prompt, "generated": generated, "alternatives": 4, "preview": 6})
    assert r.status_code == 200, r.text
    b = r.json()
    alts = b["alternatives"]
    assert b["greedy"] and b["position"] == 2 and len(alts) == 4
    assert alts[0]["id"] == greedy[2] and alts[0]["chosen"] and alts[0]["prob"] == 1.0
    assert [a["p_raw"] for a in alts[1:]] == sorted((a["p_raw"] for a in alts[1:]), reverse=True)
    prefix = ids + generated
    for a in alts:
        fresh = oracle.generate(prefix + [a["id"]], SamplingParams(temperature=0, max_tokens=6))[0]
        assert a["preview_ids"] == list(fresh.outputs[0].token_ids), a
    alt = alts[1]["id"]
    for settings in ({"temperature": 0}, {"temperature": 0.8, "seed": 7}):
        t = post(srv, "journey/trajectory", {"prompt": prompt, "generated": generated, "token": alt, "max_tokens": 12,
                                              **settings}).json()
        fresh = oracle.generate(prefix + [alt], SamplingParams(max_tokens=12, **settings))[0]
        assert t["token_ids"] == [alt] + list(fresh.outputs[0].token_ids), settings
        assert t["greedy"] == (settings["temperature"] == 0) and t["prompt_tokens"] == len(prefix) + 1
        assert 16 <= t["prefix_reused"] <= len(prefix)
    bad = post(srv, "journey/trajectory", {"prompt": prompt, "token": 10 ** 6})
    assert bad.status_code == 400


def test_the_ablate_route_reports_the_change(srv, oracle):
    """On SmolLM2: ablating layer 0's MLP changes the next token's distribution (KL > 0); the plain
    side's continuation is the greedy one; a layer or head the model lacks is a 400 naming it."""
    r = post(srv, "ablate", {"prompt": "The capital of France is", "layer": 0, "kind": "mlp", "continue_tokens": 3})
    assert r.status_code == 200, r.text
    v = r.json()
    assert v["kl"] > 0 and len(v["plain"]["continuation_ids"]) == 3 and v["plain"]["top"][0]["prob"] > 0
    want = oracle.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=3))[0]
    assert v["plain"]["continuation_ids"] == list(want.outputs[0].token_ids)
    for body, field in (({"layer": 99}, "layer"), ({"kind": "head", "head": 200}, "head")):
        bad = post(srv, "ablate", body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field, bad.text


def test_the_patch_lens_restores_all_at_the_last_layer(srv):
    """Activation patching on SmolLM2: " Paris" against " Rome"; patching prompt B's last residual
    after the last layer restores all of B's answer (1.0), after layer 0 next to none of it; prompts
    of different token counts are a 400 naming the field."""
    r = post(srv, "patch", {"clean": "The Eiffel Tower is in the city of", "corrupt": "The Colosseum is in the city of"})
    assert r.status_code == 200, r.text
    v = r.json()
    assert v["answer_clean"]["id"] != v["answer_corrupt"]["id"] and len(v["layers"]) == 30
    assert v["layers"][-1]["restored"] == pytest.approx(1.0, abs=1e-3)
    assert abs(v["layers"][0]["restored"]) < 0.5 and v["logit_diff_corrupt"] > v["logit_diff_clean"]
    bad = post(srv, "patch", {"clean": "Paris", "corrupt": "The Colosseum is in the city of"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "corrupt"


def test_quantization_diff_per_layer(srv):
    """The served SmolLM2 (Q4_1/Q8_0 codes, bf16) against its float32 reference, per layer: every
    residual stream close (cosine > 0.9) but not identical, the drift growing from the first
    layer to the last, and a small KL at the head; the route's numbers match a second call."""
    body = {"prompt": "The quick brown fox jumps over the lazy dog."}
    v = post(srv, "quant/layers", body).json()
    layers = v["layers"]
    assert len(layers) == 30 and all(0.9 < l["cos"] <= 1.0 + 1e-6 and l["rel"] > 0 for l in layers), layers
    assert layers[-1]["rel"] > layers[0]["rel"] and 0 <= v["kl_next"] < 0.5
    assert post(srv, "quant/layers", body).json()["layers"] == layers  # deterministic passes


def test_lens_grid_is_the_lens_at_every_position(srv):
    """The heatmap's cells are the per-position lens' top tokens, for every layer and position."""
    trace = post(srv, "trace", {"prompt": "The animal didn't cross the street"}).json()
    grid = httpx.get(f"{srv.url}/inspect/api/trace/{trace['trace_id']}/lens_grid", timeout=60).json()
    t = len(trace["tokens"])
    assert grid["positions"] == t and len(grid["cells"]) == 31 and grid["rows"][0] == "embedding"
    for p in (0, t // 2, t - 1):
        lens = httpx.get(f"{srv.url}/inspect/api/trace/{trace['trace_id']}/lens", params={"position": p, "top": 1}).json()
        for layer, row in enumerate(lens["layers"]):
            assert grid["cells"][layer][p]["id"] == row["top"][0]["id"]
            assert grid["cells"][layer][p]["prob"] == pytest.approx(row["top"][0]["prob"], abs=2e-4)


def test_kv_contrast_runs_the_same_continuation_both_ways(srv, oracle):
    """With the cache: greedy generate's tokens; without: each step a request that recomputes the
    prefix, predicting the same tokens; one time per step and position for each (how long they
    take is the benchmark's business, not a test's)."""
    prompt = "The history of the printing press began"
    r = post(srv, "kv/contrast", {"prompt": prompt, "tokens": 6})
    assert r.status_code == 200, r.text
    v = r.json()
    want = oracle.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert v["tokens"] == want.token_ids and v["same_tokens"]
    n = len(oracle.tokenizer.encode(prompt))
    assert v["prompt_tokens"] == n and v["positions"] == list(range(n + 1, n + 6))
    assert len(v["with_cache_ms"]) == len(v["without_cache_ms"]) == 5
    assert all(x > 0 for x in v["with_cache_ms"] + v["without_cache_ms"])


def test_beam_tree_best_beam_equals_beam_search(srv, oracle):
    r = post(srv, "beam", {"prompt": "The best thing about", "beam_width": 3, "max_tokens": 4})
    assert r.status_code == 200, r.text
    tree = r.json()
    ids = oracle.tokenizer.encode("The best thing about")
    want = oracle.beam_search([ids], 3, 4)[0].sequences[0]
    assert tree["beams"][0]["ids"] == want.token_ids
    assert tree["beams"][0]["cumulative_logprob"] == pytest.approx(want.cumulative_logprob, abs=1e-3)
    greedy = oracle.generate(ids, SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids
    assert tree["greedy"]["ids"] == greedy
    for step in range(4):
        fates = [n["fate"] for n in tree["nodes"] if n["step"] == step]
        assert fates.count("beam") + fates.count("finished") >= 1 and fates.count("beam") <= 3


def test_trace_is_a_request_and_serving_goes_on(srv, oracle):
    """A trace runs while another request generates; that request's greedy text equals a run
    alone, and the trace's rows sum to 1."""
    import concurrent.futures

    alone = oracle.generate("Write a poem about rivers.", SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].text
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        chat = pool.submit(httpx.post, f"{srv.url}/v1/completions", json={
            "model": "smollm2", "prompt": "Write a poem about rivers.", "max_tokens": 24, "temperature": 0}, timeout=120)
        tr = pool.submit(post, srv, "trace", {"prompt": "The cat sat on the mat because it was tired"})
        assert chat.result().json()["choices"][0]["text"] == alone
        trace = tr.result().json()
    t = len(trace["tokens"])
    assert trace["layers"] == 30 and trace["heads"] == 9 and len(trace["labels"]) == 30
    a = httpx.get(f"{srv.url}/inspect/api/trace/{trace['trace_id']}/attention", params={"layer": 5}).json()
    import base64

    w = np.frombuffer(base64.b64decode(a["data"]), dtype=np.uint8).reshape(9, t, t) / 255
    np.testing.assert_allclose(w.sum(-1), 1, atol=t / 255)
    assert (np.triu(w, 1) == 0).all()
    lens = httpx.get(f"{srv.url}/inspect/api/trace/{trace['trace_id']}/lens", params={"position": t - 1}).json()
    assert len(lens["layers"]) == 31
    nxt = oracle.generate("The cat sat on the mat because it was tired", SamplingParams(temperature=0, max_tokens=1))
    assert lens["layers"][-1]["top"][0]["id"] == nxt[0].outputs[0].token_ids[0]


def test_timeline_and_live_state(srv):
    r = post(srv, "run", {"prompt": "The three most important inventions are", "max_tokens": 8}).json()
    phases = [s["phase"] for s in r["steps"]]
    assert phases[0] == "prefill" and sum(s["tokens"] for s in r["steps"] if s["phase"] == "prefill") == r["prompt_tokens"]
    assert phases.count("decode") == r["output_tokens"] - 1 and r["ttft_ms"] > 0
    assert post(srv, "demo", {"count": 3, "max_tokens": 8}).json()["sent"] == 3
    end = time.time() + 60  # (the demo's requests reach the engine after the answer: wait for them to finish)
    while len(httpx.get(f"{srv.url}/inspect/api/state").json()["requests"]) < 4 and time.time() < end:
        time.sleep(0.05)
    assert srv.idle(60)
    st = httpx.get(f"{srv.url}/inspect/api/state").json()
    assert len(st["blocks"]) == st["stats"]["num_blocks"] and set(st["blocks"]) <= set(".c123456789+")
    assert len(st["requests"]) >= 4 and st["steps"]
    assert st["stats"]["num_failed"] == 0 and isinstance(st["stats"]["kernel_fallbacks"], dict)  # shown on the page
    with httpx.stream("GET", f"{srv.url}/inspect/api/live", timeout=30) as ev:  # the contract run skips it
        assert ev.status_code == 200 and ev.headers["content-type"].startswith("text/event-stream")
        line = next(line for line in ev.iter_lines() if line.startswith("data: "))
    assert json.loads(line[6:])["stats"]["num_blocks"] == st["stats"]["num_blocks"]


@pytest.mark.parametrize("path, body, field", [
    ("tokenize", {"text": ""}, "text"),
    ("trace", {"prompt": "word " * (MAX_TRACE_TOKENS + 10)}, "prompt"),
    ("embeddings", {"words": ["king", "queen", "xqzwvjk"]}, "words"),
    ("sample", {"temperature": 7}, "temperature"),
    ("sample", {"top_p": 0}, "top_p"),
    ("beam", {"beam_width": 20}, "beam_width"),
    ("bpe", {"word": "x" * 100}, "word"),
    ("analogy", {"target": "xqzwvjk"}, "target"),
    ("journey/step", {"generated": [10 ** 6]}, "generated"),
    ("journey/step", {"generated": [5] * 300}, "generated"),
])
def test_bad_input_is_a_400_naming_the_field(srv, path, body, field):
    r = post(srv, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field, err
    if path == "trace":
        assert str(MAX_TRACE_TOKENS) in err["message"]
    assert post(srv, "tokenize", {"text": "still serving"}).status_code == 200


def test_page_routes_schema_and_switches(srv, tiny_gguf):
    page = httpx.get(f"{srv.url}/inspect")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert httpx.get(f"{srv.url}/inspect/static/app.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(f"{srv.url}/inspect/static/..%2Fserver").status_code in (400, 404)
    paths = httpx.get(f"{srv.url}/openapi.json").json()["paths"]
    for p in ("/inspect/api/trace", "/inspect/api/sample", "/inspect/api/live", "/inspect/api/kv"):
        assert p in paths
    off = LiveServer(LLM(str(tiny_gguf["llama"][0])), "tiny", inspect=False, api_key="k")
    try:
        assert httpx.get(f"{off.url}/inspect", headers={"Authorization": "Bearer k"}).status_code == 404
    finally:
        off.stop()
    keyed = LiveServer(LLM(str(tiny_gguf["llama"][0])), "tiny", api_key="k")
    try:
        assert httpx.get(f"{keyed.url}/inspect").status_code == 401
        assert httpx.get(f"{keyed.url}/inspect", params={"key": "k"}).status_code == 200
        assert httpx.get(f"{keyed.url}/inspect/api/kv", params={"key": "wrong"}).status_code == 401
        assert httpx.get(f"{keyed.url}/v1/models", params={"key": "k"}).status_code == 401  # only /inspect
    finally:
        keyed.stop()


def test_page_code_is_small_plain_and_local():
    """The page's own code: plain ES modules, 150 KB of JavaScript at most in all, no address
    outside the server, and every chart (svg, canvas) in the HTML with a text alternative."""
    import re
    from pathlib import Path

    static = Path(text.__file__).resolve().parent / "static"
    scripts = sorted(static.glob("*.js"))
    assert scripts and sum(p.stat().st_size for p in scripts) <= 150_000
    for p in [*scripts, static / "index.html", static / "inspect.css"]:
        src = p.read_text()
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}/", src.replace("http://www.w3.org/2000/svg", "")), p.name
        assert "require(" not in src
    html = (static / "index.html").read_text()
    charts = re.findall(r"<(?:svg|canvas)\b[^>]*>", html)
    assert charts and all('aria-label="' in c for c in charts), [c for c in charts if "aria-label" not in c]


def test_kv_bytes_formula_with_an_int8_cache(tiny_gguf):
    """int8 codes plus a float32 scale per row: the formula still equals the cache's bytes, and
    the sliding rings (gemma3) stay in the model's dtype."""
    from nextoken import LLM

    for arch in ("llama", "gemma3"):
        eng = LLM(str(tiny_gguf[arch][0]), dtype="float32", kv_cache_dtype="int8", max_model_len=64).engine
        v, kv = engine_view.kv_view(EngineView(eng)), eng.runner.kv
        paged = kv.k.nbytes + kv.v.nbytes + kv.k_scale.nbytes + kv.v_scale.nbytes
        assert v["bytes_per_token"] == v["measured_bytes_per_token"] == paged // (kv.num_blocks * kv.block_size)
        assert v["formula"]["bytes_per_value"] == 1 and v["formula"]["scale_bytes_per_row"] == 4
        if arch == "gemma3":
            assert v["sliding"]["bytes_per_token"] == eng.config.sliding_kv_bytes_per_token(4)


def test_the_live_state_shows_the_sliding_window_layers_blocks(tiny_gguf):
    """Gemma 3 (window 8, blocks of 4, rings of 3): the live state's second pool and each
    running sequence's ring (its slots' blocks and the logical blocks they hold) are the
    manager's; a model without such layers has neither."""
    from nextoken import LLM, SamplingParams

    llm = LLM(str(tiny_gguf["gemma3"][0]), dtype="float32", block_size=4)
    eng = llm.engine
    eng.add_request(list(range(3, 33)), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    eng.step()
    st = engine_view.live_state(EngineView(eng))
    kv = eng.kv
    assert len(st["sliding"]["blocks"]) == kv.sliding_pool.num_blocks and st["sliding"]["window"] == 8
    ring = st["running"][0]["ring"]
    assert ring["slots"] == kv.ring_ids(st["running"][0]["sequence"])
    assert sorted(ring["logical"]) == [5, 6, 7] and [j % 3 for j in ring["logical"]] == [0, 1, 2]
    assert sorted(int(j) for j in ring["off_ring"]) == [0, 1, 2, 3, 4]  # the long prompt's early blocks
    assert st["sliding"]["blocks"].count("1") == 8
    while eng.has_unfinished_requests():
        eng.step()
    st = engine_view.live_state(EngineView(eng))
    assert st["sliding"]["cached_blocks"] > 0 and set(st["sliding"]["blocks"]) <= {".", "c"}
    plain = engine_view.live_state(EngineView(LLM(str(tiny_gguf["llama"][0]), dtype="float32").engine))
    assert plain["sliding"] is None


def test_equal_scores_rank_by_id_in_the_lens_and_the_commitment_strip():
    """bf16 logits tie (SmolLM2's lens once gave "," and "." one probability after layer 25, and
    `torch.topk` put the higher id first while the strip ranked both 0): `ranked` orders equal
    scores by id, as greedy decoding's argmax does, and the strip's ranks agree with it."""
    from nextoken.inspect.journey import commitment
    from nextoken.inspect.trace import ranked

    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 6, (40, 300), generator=g).float() / 8  # many ties at every rank
    rows[3] = 0.5  # one row all equal
    vals, ids = ranked(rows, 7)
    for row, v, i in zip(rows.tolist(), vals.tolist(), ids.tolist()):
        want = sorted(range(len(row)), key=lambda t: (-row[t], t))[:7]
        assert i == want and v == [row[t] for t in want]
    probs = torch.cat([torch.zeros(1, 300), rows])  # the embeddings' row first, as the lens gives it
    for token in (int(ids[0, 0]), int(ids[0, 1]), int(ids[5, 3]), 299):
        ranks = commitment(probs, token)["ranks"]
        assert ranks == [sorted(range(300), key=lambda t: (-row[t], t)).index(token) for row in rows.tolist()]
    assert ranked(rows[:2], 1000)[1].shape == (2, 300)  # k beyond the row: every index
