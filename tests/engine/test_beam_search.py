"""Beam search in the engine against `transformers`' beam search on a tiny random model."""

from __future__ import annotations

import pytest
import torch

from nextoken.errors import InvalidRequest
from nextoken.llm import LLM
from tests.helpers.engine import assert_no_leak
from tests.tiny_models import tiny_hf_model, write_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = tiny_hf_model("qwen2", seed=1)
    path = tmp_path_factory.mktemp("beam") / "tiny-qwen2.gguf"
    write_gguf(hf, path, "qwen2")
    return hf, LLM(str(path), dtype="float32", block_size=4)


@pytest.mark.parametrize("width,max_tokens,length_penalty,ignore_eos", [
    (4, 6, 1.0, True), (3, 7, 0.5, True), (2, 5, 2.0, True), (4, 10, 1.0, False)])
def test_beams_and_scores_equal_transformers(tiny, width, max_tokens, length_penalty, ignore_eos):
    hf, llm = tiny
    eog = sorted(llm.engine.tokenizer.eog_token_ids)
    for prompt in ([5, 17, 200, 33, 41, 270, 90, 12], [3, 4, 5]):
        ours = llm.beam_search([prompt], width, max_tokens, length_penalty, ignore_eos)[0].sequences
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                              max_new_tokens=max_tokens, do_sample=False, length_penalty=length_penalty,
                              eos_token_id=None if ignore_eos else eog, pad_token_id=1,
                              output_scores=True, return_dict_in_generate=True)
        assert len(ours) == width
        for i, beam in enumerate(ours):
            expected = ref.sequences[i, len(prompt):].tolist()[: len(beam.token_ids)]  # HF pads finished beams
            assert beam.token_ids == expected, (prompt, i)
            assert beam.score == pytest.approx(float(ref.sequences_scores[i]), abs=1e-4)
        assert [b.score for b in ours] == sorted((b.score for b in ours), reverse=True)
    assert_no_leak(llm)


def test_beams_share_blocks_and_batch_prompts(tiny):
    _, llm = tiny
    pool = llm.engine.kv.pool
    hits_before = pool.hits
    outs = llm.beam_search([[5, 17, 200, 33, 41, 270, 90, 12, 7, 9], [3, 4, 5]], 3, 8, ignore_eos=True)
    assert len(outs) == 2 and all(len(o.sequences) == 3 for o in outs)
    assert pool.hits - hits_before > 10  # each step's beams found their common prefix's blocks cached
    alone = llm.beam_search([[3, 4, 5]], 3, 8, ignore_eos=True)[0]
    assert [b.token_ids for b in alone.sequences] == [b.token_ids for b in outs[1].sequences]
    assert_no_leak(llm)


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_each_step_computes_one_token_a_beam(tiny, tiny_gguf, arch):
    """A step's beam requests find their parent's part-filled last block cached and copy it
    (`KVCacheManager.get_partial_block`; Gemma 3: its sliding-window ring's block too, the
    window of 8 wrapping a ring of 3 blocks): after the prompt, each step computes one token a
    beam, where it computed the tokens since the last full block again (up to block_size a
    beam); the beams stay `transformers`' (above) and equal those of an engine without the
    prefix cache."""
    llm = tiny[1] if arch == "qwen2" else LLM(str(tiny_gguf[arch][0]), dtype="float32", block_size=4)
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1]  # 9 tokens, blocks of 4: the last block part-filled from the start
    computed = []

    def count(stats):
        computed.append(sum(n for _, n in stats.prefill) + len(stats.decode))

    llm.engine.subscribe(count)
    try:
        beams = llm.beam_search([prompt], 3, 9, ignore_eos=True)[0].sequences
    finally:
        llm.engine.subscribers.remove(count)
    assert computed == [9] + [3] * 8, computed  # the prompt, then one token for each of the three beams
    plain = LLM(str(llm.engine.model_path), dtype="float32", block_size=4, enable_prefix_caching=False)
    try:
        ref = plain.beam_search([prompt], 3, 9, ignore_eos=True)[0].sequences
    finally:
        plain.close()
    assert [b.token_ids for b in beams] == [b.token_ids for b in ref]
    assert [b.cumulative_logprob for b in beams] == pytest.approx([b.cumulative_logprob for b in ref], abs=1e-5)
    assert_no_leak(llm)
    if llm is not tiny[1]:
        llm.close()


def test_bad_width_is_refused(tiny):
    with pytest.raises(InvalidRequest, match="beam_width"):
        tiny[1].beam_search([[3, 4]], 0, 4)


def test_the_engine_queues_each_beam_step_before_the_next_schedule(tiny):
    """The engine drives a search (`engine.beam_groups`): in the very step its beams get their
    next token, it queues the next step's requests at the front of the waiting queue, ahead of
    requests that arrived before them (continuations keep the search's place), and only the
    search's own id comes out, once, with the beams equal to `LLM.beam_search`'s."""
    from nextoken.beam import BeamSearch
    from nextoken.sampling_params import SamplingParams

    want = tiny[1].beam_search([[5, 17, 200, 33, 41, 270, 90, 12]], 3, 5, 1.0, True)[0].sequences
    llm = LLM(str(tiny[1].engine.model_path), dtype="float32", block_size=4, max_num_seqs=4)  # 3 beams + 1
    eng = llm.engine
    prompt = [5, 17, 200, 33, 41, 270, 90, 12]
    search = BeamSearch([prompt], 3, 5, 1.0, True, eng.tokenizer.eog_token_ids)
    rid = eng.add_beam_search(prompt, search)
    for i in range(5):  # arrive after the search: three run beside it, two wait; none passes its later steps
        eng.add_request([7, 8, 9, 10 + i], SamplingParams(max_tokens=12, ignore_eos=True), f"bg{i}")
    seen, final, waited = set(), None, 0
    while eng.has_unfinished_requests():
        before = search.step
        for out in eng.step():
            seen.add(out.request_id)
            if out.request_id == rid:
                final = out
        if search.step > before and not search.done:
            order = [r.group_id for r in eng.scheduler.waiting.ordered()]
            n = len(search.pending())
            assert n and all(g.startswith(f"{rid}/beam{search.step}.") for g in order[:n]), order
            waited += any(g.startswith("bg") for g in order[n:])
    assert waited  # requests that arrived earlier were waiting behind the search's next step
    assert seen == {rid} | {f"bg{i}" for i in range(5)}
    assert [c.token_ids for c in final.outputs] == [b.token_ids for b in want] and final.finished
    assert_no_leak(llm)
    llm.close()


def test_a_search_that_outgrows_the_cache_fails_alone(tiny):
    """A search whose beams outgrow the KV cache (each step's request is checked as it is queued,
    on the stepping thread) ends with its error; the engine and the other requests go on."""
    from nextoken.errors import RequestFailed
    from nextoken.sampling_params import SamplingParams

    llm = LLM(str(tiny[1].engine.model_path), dtype="float32", block_size=4, num_kv_blocks=6)  # 24 token slots
    llm.engine.add_request([9, 8, 7], SamplingParams(max_tokens=4, ignore_eos=True), "other")
    with pytest.raises(RequestFailed, match="KV cache blocks"):
        llm.beam_search([[5, 17, 200, 33, 41, 270, 90, 12]], 2, 30, 1.0, True)
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids
    assert_no_leak(llm)
    llm.close()


def test_a_search_whose_step_raises_fails_alone(tiny, monkeypatch):
    """A fault inside a search's selection (once an OverflowError of an extreme length penalty)
    runs on the stepping thread: it ends that search with its error, and the engine steps on."""
    from nextoken import beam
    from nextoken.errors import RequestFailed
    from nextoken.sampling_params import SamplingParams

    llm = tiny[1]

    def broken(self, top):
        raise OverflowError("Numerical result out of range")

    monkeypatch.setattr(beam.BeamSearch, "advance", broken)
    with pytest.raises(RequestFailed, match="beam search failed \\(OverflowError"):
        llm.beam_search([[5, 17, 200]], 2, 4, 1.0, True)
    monkeypatch.undo()
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids
    assert llm.beam_search([[5, 17, 200]], 2, 4, 1.0, True)[0].sequences
    assert_no_leak(llm)
