"""Gemma 3: sliding-window layers over a ring of KV blocks, against `transformers`' Gemma3ForCausalLM
(tiny random model, window 8, written as GGUF), and the real Gemma 3 270M."""

from __future__ import annotations

import random

import pytest
import torch

from nextoken import LLM, SamplingParams
from nextoken.loader.gguf import GGUFFile
from nextoken.runner.model_runner import ModelRunner
from tests.conftest import load_reference
from tests.tiny_models import OneSequence
from tests.helpers.engine import assert_no_leak

WINDOW = 8


def _prompt(n, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(3, 270) for _ in range(n)]


def _hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("chunks", [[40], [5, 7, 9, 19], [1] * 6 + [30], [13, 1, 1, 25]])
def test_chunked_prefill_over_the_ring_equals_transformers(tiny_gguf, chunks):
    """40 tokens (the ring holds 12) in chunks of any size: every position's logits equal
    transformers' full forward, so each chunk read the keys before it before overwriting them."""
    path, hf = tiny_gguf["gemma3"]
    prompt = _prompt(sum(chunks))
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    for reference in (False, True):
        seq = OneSequence(ModelRunner(GGUFFile(path), torch.float32, reference=reference), 64, block_size=4)
        got, at = [], 0
        for n in chunks:
            got.append(seq.forward(prompt[at : at + n], all_logits=True))
            at += n
        assert (torch.cat(got) - expected).abs().max() < 1e-4


def test_window_matters(tiny_gguf):
    """The oracle can tell: a model that ignores the window (all layers global) is far off."""
    import dataclasses

    path, hf = tiny_gguf["gemma3"]
    prompt = _prompt(30)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    runner = ModelRunner(GGUFFile(path), torch.float32)
    runner.config = dataclasses.replace(runner.config, sliding_window=None, layer_types=None)
    for layer in runner.model.layers:
        layer.self_attn.sliding = False
    runner.model.config = runner.config
    got = OneSequence(runner, 64, block_size=4).forward(prompt)
    assert (got - expected).abs().max() > 1e-2


@pytest.mark.parametrize("settings", [
    {},
    {"max_num_batched_tokens": 7},  # chunked prefills mixed with decodes
    {"speculative_method": "ngram", "num_speculative_tokens": 3},  # verification rows in the ring
    {"num_kv_blocks": 30},  # preemption
])
def test_engine_greedy_equals_transformers(tiny_gguf, settings):
    path, hf = tiny_gguf["gemma3"]
    prompts = [_prompt(n, seed=n) for n in (3, 9, 17, 30, 41)]
    prompts.append(_prompt(6, seed=1) * 5)  # repetitive: n-gram drafts get accepted
    llm = LLM(str(path), dtype="float32", block_size=4, max_num_seqs=4, **settings)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _hf_greedy(hf, p, 14)
    assert_no_leak(llm)  # (the rings of ended requests wait, parked, for a next turn)


def test_sliding_layers_keep_only_their_window(tiny_gguf):
    """Each sequence's ring is its window plus the blocks a pass may add (here 3 blocks of 4 for
    a window of 8); the paged cache serves the global layer alone."""
    llm = LLM(str(tiny_gguf["gemma3"][0]), dtype="float32", block_size=4, max_num_seqs=4, num_kv_blocks=64)
    kv = llm.engine.runner.kv
    assert kv.sliding.ring_blocks * 4 <= WINDOW + 4 and kv.sliding.k.shape[2] == 4 * kv.sliding.ring_blocks
    assert kv.k.shape[0] == 1 and kv.sliding.k.shape[0] == 5  # 1 global layer, 5 local
    llm.generate([_prompt(50)], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert len(llm.engine.kv.rings) == 0  # freed with the request


# -- the real model ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma_path():
    from nextoken.catalog import pull

    return pull("gemma-3-270m", progress=False)


@pytest.fixture(scope="module")
def gemma(gemma_path):
    return LLM(str(gemma_path), dtype="bfloat16", max_num_seqs=4, max_model_len=1024)


def test_real_tokenizer_ids_equal_reference(gemma):
    tok = gemma.engine.tokenizer
    for case in load_reference("gemma-3-270m")["tokenize"]:
        assert tok.encode(case["text"], add_bos=False) == case["ids"], case["text"]
        assert tok.decode(case["ids"]) == case["text"]
    assert tok.encode("Hi")[0] == tok.bos_token_id == 2  # Gemma expects <bos> first


def test_real_greedy_generation_is_coherent(gemma):
    out = gemma.generate(["The capital of France is", "def fibonacci(n):"],
                         SamplingParams(temperature=0, max_tokens=16))
    assert "France" in out[0].outputs[0].text or "Paris" in out[0].outputs[0].text
    assert "return" in out[1].outputs[0].text


def test_real_long_prompt_beyond_the_window(gemma):
    """A 600-token prompt (past the 512-token window of the local layers): the continuation of a
    counted list is the next number."""
    text = ", ".join(str(i) for i in range(1, 150))
    out = gemma.generate([text + ","], SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.outputs[0].text.strip().startswith("150")
    assert len(gemma.engine.tokenizer.encode(text)) > 512


def test_real_tokenizer_reads_its_merges_back(gemma, gemma_path, monkeypatch):
    """Gemma 3's SentencePiece merges (found from its 262k pieces in a second: the GGUF keeps
    none) were kept in the cache by the engine's first build (`loader.prepared.merges_path`); a
    build from them, without finding any, tokenizes as the reference does."""
    import nextoken.tokenizer.tokenizer as tokenizer
    from nextoken.loader.prepared import merges_path
    from nextoken.tokenizer import Tokenizer

    assert merges_path(gemma_path).is_file()
    monkeypatch.setattr(tokenizer, "sentencepiece_merges", lambda *a: pytest.fail("the merges were found again"))
    tok = Tokenizer.from_gguf(GGUFFile(gemma_path), merges_path(gemma_path))
    for case in load_reference("gemma-3-270m")["tokenize"]:
        assert tok.encode(case["text"], add_bos=False) == case["ids"], case["text"]


def test_kept_merges_are_found_again_when_damaged_or_of_another_vocabulary(gemma_path, tmp_path, monkeypatch):
    """`cached_sentencepiece_merges` over the first 20k pieces of Gemma 3's vocabulary: written on
    the first call, read on the next (nothing found), found again (the same merges) for a
    truncated file or one whose ids lie past this vocabulary."""
    import numpy as np

    import nextoken.tokenizer.tokenizer as tokenizer

    tokens = [str(t) for t in GGUFFile(gemma_path).require("tokenizer.ggml.tokens")[:20000]]
    ranks = list(range(len(tokens)))
    expected = tokenizer.sentencepiece_merges(tokens, ranks)
    assert len(expected) > 1000
    path = tmp_path / "prepared" / "m-merges-v1.npy"
    assert tokenizer.cached_sentencepiece_merges(tokens, ranks, path) == expected and path.is_file()
    finder = tokenizer.sentencepiece_merges
    monkeypatch.setattr(tokenizer, "sentencepiece_merges", lambda *a: pytest.fail("the merges were found again"))
    assert tokenizer.cached_sentencepiece_merges(tokens, ranks, path) == expected
    monkeypatch.setattr(tokenizer, "sentencepiece_merges", finder)
    for damaged in (path.read_bytes()[:1000], None):
        if damaged is None:  # a file of a larger vocabulary
            np.save(path, np.array([[0, len(tokens)]], dtype=np.int32))
        else:
            path.write_bytes(damaged)
        assert tokenizer.cached_sentencepiece_merges(tokens, ranks, path) == expected
        assert np.load(path).shape == (len(expected), 2)  # written again, whole
