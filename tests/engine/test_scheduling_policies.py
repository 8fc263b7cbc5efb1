"""The scheduling policies on the real model (SmolLM2-135M): the order requests get their first
token under ``priority``, the share of tokens two clients get under ``fair``, and the refusal of
a priority the policy does not use."""

from __future__ import annotations

import pytest

from nextoken import LLM
from nextoken.errors import InvalidRequest
from nextoken.request_options import RequestOptions
from nextoken.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llms(smollm2_path):
    made = {p: LLM(str(smollm2_path), max_num_seqs=2, scheduling_policy=p) for p in ("priority", "fair")}
    yield made
    for llm in made.values():
        llm.close()


def run_until_done(engine, on_finish=None, max_steps=2000):
    """Step `engine` until it is idle; returns {request id: step of its first token} and the
    finished outputs in order. `on_finish(out, step)` may add requests."""
    first, finished, step = {}, [], 0
    while engine.has_unfinished_requests() and step < max_steps:
        for out in engine.step():
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = step
            if out.finished:
                finished.append(out)
                if on_finish:
                    on_finish(out, step)
        step += 1
    assert not engine.has_unfinished_requests()
    return first, finished


def test_priority_orders_first_tokens_and_preempts_the_lowest(llms):
    """Two priority-10 requests fill the two sequence slots; then three more priority-10
    requests and one of priority 0 arrive. The priority-0 request preempts a running one and has
    its first token before every later priority-10 request, and the preempted request still
    finishes with the text it would have had alone (greedy)."""
    eng = llms["priority"].engine
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llms["priority"].generate(["Tell me a story about a dragon."], params)[0].outputs[0].text
    for i in range(2):
        eng.add_request("Tell me a story about a dragon." if i == 0 else f"Count to ten, number {i}.", params,
                        f"bg{i}", RequestOptions(priority=10))
    eng.step()
    for i in range(2, 5):
        eng.add_request(f"Count to ten, number {i}.", params, f"bg{i}", RequestOptions(priority=10))
    eng.add_request("What is two plus two?", params, "urgent", RequestOptions(priority=0))
    first, finished = run_until_done(eng)
    assert first["urgent"] <= 2
    assert all(first["urgent"] < first[f"bg{i}"] for i in range(2, 5))
    assert eng.stats()["num_preemptions"] >= 1
    text = {o.request_id: o.outputs[0].text for o in finished}
    assert text["bg0"] == alone


def test_fair_shares_tokens_between_a_busy_and_a_lone_client(llms):
    """Client A queues 24 requests at once; client B keeps one request in flight, sending the next
    as soon as one finishes. With two sequence slots, under ``fair`` B's share of the tokens
    generated while both are active is within 20% of an equal share (under first come, first
    served B would wait behind all of A's)."""
    eng = llms["fair"].engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i in range(24):
        eng.add_request(f"Write a line of poem {i}.", params, f"a{i}", RequestOptions(client="A"))
    sent = [0]

    def send_b():
        eng.add_request(f"Name a colour, take {sent[0]}.", params, f"b{sent[0]}", RequestOptions(client="B"))
        sent[0] += 1

    send_b()
    tokens = {"A": 0, "B": 0}
    a_done = [0]

    def on_finish(out, step):
        client = out.request_id[0].upper()
        if a_done[0] < 24:  # both clients active
            tokens[client] += len(out.outputs[0].token_ids)
        if client == "A":
            a_done[0] += 1
        elif a_done[0] < 24:
            send_b()

    run_until_done(eng, on_finish)
    share = tokens["B"] / (tokens["A"] + tokens["B"])
    assert abs(share - 0.5) <= 0.1, (tokens, share)


def test_a_priority_needs_the_priority_policy(smollm2_llm):
    """Under the default policy (fcfs), a priority other than 0 is refused naming ``priority``,
    as vLLM refuses it; 0 is accepted."""
    eng = smollm2_llm.engine
    with pytest.raises(InvalidRequest) as e:
        eng.add_request("Hi", SamplingParams(max_tokens=1), "p", RequestOptions(priority=3))
    assert e.value.field == "priority" and "--scheduling-policy priority" in str(e.value)
    with pytest.raises(InvalidRequest):
        eng.add_request("Hi", SamplingParams(max_tokens=1), "q", RequestOptions(priority=1.5))
    rid = eng.add_request("Hi", SamplingParams(max_tokens=1), "r", RequestOptions(priority=0))
    eng.abort_request(rid)
    eng.step()


def test_llm_generate_takes_a_priority_per_prompt(llms):
    """`LLM.generate(..., priority=[...])` as vLLM's: with two sequence slots, the two prompts of
    priority 0 get their first tokens before the two of priority 5 queued ahead of them."""
    llm = llms["priority"]
    outs = llm.generate(["One", "Two", "Three", "Four"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        priority=[5, 5, 0, 0])
    first = [o.metrics.first_token_time for o in outs]
    assert max(first[2:]) < min(first[:2])
    with pytest.raises(InvalidRequest) as e:
        llm.generate(["One", "Two"], priority=[1])
    assert e.value.field == "priority"
