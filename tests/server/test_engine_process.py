"""The engine in a process of its own (``serve --engine-process``, `engine.core` and
`engine.core_client`): the outputs' deltas rebuild what the engine made, errors cross the process
with their field, a dead engine process fails its streams. The server's own tests over it are
the ``engine-process`` case of tests/server/test_server.py's ``tiny`` fixture."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pickle
import signal

import pytest

from nextoken import LLM, SamplingParams
from nextoken.beam import BeamSearch
from nextoken.engine.core import OutputMirror, OutputWire
from nextoken.engine.core_client import EngineProcessClient
from nextoken.engine.protocol import EngineClient
from nextoken.engine_args import EngineArgs
from nextoken.errors import EngineError, InvalidRequest, ModelLoadError
from nextoken.request_options import RequestOptions


@pytest.mark.parametrize("direct,text_here", [(False, False), (True, False), (True, True)],
                         ids=["from-outputs", "from-groups", "text-in-the-front-end"])
def test_the_wire_rebuilds_every_output_the_engine_makes(tiny_gguf, direct, text_here):
    """Every `RequestOutput` of a mixed workload (n=2 sampled with logprobs, a stop string,
    prompt logprobs, greedy, a beam search; one aborted midway and its id used again), sent as deltas and
    pickled, is rebuilt equal to the engine's own: text, deltas, token ids, log-probabilities,
    finish, metrics. `direct`: the engine makes the records from its requests' state
    (`OutputWire.encode_group`, as the engine process does), and a twin engine given the same
    requests makes the outputs they must equal (all but the times). `text_here`: the requests
    without stop strings reach the engine with ``RequestOptions(detokenize=False)`` (as
    `EngineProcessClient` sends them), so their records carry ids alone, and the mirror makes
    their text: the same text and deltas as the twin's own detokenizer."""
    path = str(tiny_gguf["llama"][0])
    engine = LLM(path, dtype="float32").engine
    twin = LLM(path, dtype="float32").engine if direct else None
    wire, mirror = OutputWire(), OutputMirror(engine.tokenizer)

    def add(prompt, params, rid):
        if text_here and not params.stop:
            mirror.expect(rid, params)
        engine.add_request(prompt, params, rid, RequestOptions(detokenize=not (text_here and not params.stop)))
        if twin is not None:
            twin.add_request(prompt, params, rid)

    add("the cat sat", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), "greedy")
    add("a b c", SamplingParams(temperature=0.9, seed=3, n=2, max_tokens=9, logprobs=2, ignore_eos=True), "sampled")
    add([5, 17, 200, 33], SamplingParams(temperature=0, max_tokens=10, prompt_logprobs=1, ignore_eos=True), "scored")
    add("the cat", SamplingParams(temperature=0.7, seed=5, max_tokens=40, stop=["a"], ignore_eos=True), "stopped")
    add("x y", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), "aborted")
    for e in filter(None, (engine, twin)):  # (a search's own requests' outputs stay `RequestOutput`s, and its final one)
        ids = e.tokenizer.encode("a cat")
        e.add_beam_search(ids, BeamSearch([ids], 2, 6, 1.0, True, e.tokenizer.eog_token_ids), "beam")
    rebuilt = 0
    for step in range(200):
        if step == 3:
            for e in filter(None, (engine, twin)):
                e.abort_request("aborted")
            wire.forget("aborted")
            mirror.forget("aborted")
            add("x y z", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), "aborted")
        if not engine.has_unfinished_requests():
            break
        if direct:
            want, records = twin.step(), engine.step(make=wire.encode_group)
            records = [r if type(r) is tuple else wire.encode(r) for r in records]  # (as `EngineCore` sends them)
        else:
            want = engine.step()
            records = [wire.encode(out) for out in want]
        assert [r[0] for r in records] == [out.request_id for out in want]
        for record, out in zip(records, want):
            got = mirror.decode(pickle.loads(pickle.dumps(record)))
            if direct:
                times = ("arrival_time", "first_token_time", "finished_time", "first_scheduled_time")
                assert dataclasses.replace(got.metrics, **dict.fromkeys(times, 0.0)) == \
                       dataclasses.replace(out.metrics, **dict.fromkeys(times, 0.0))
                assert [getattr(got.metrics, t) is None for t in times] == [getattr(out.metrics, t) is None for t in times]
                got.metrics = out.metrics
            assert got == out, out.request_id
            assert [c.delta for c in got.outputs] == [c.delta for c in out.outputs]
            assert [c.delta_logprobs for c in got.outputs] == [c.delta_logprobs for c in out.outputs]
            rebuilt += 1
    assert not engine.has_unfinished_requests() and rebuilt > 30
    assert not mirror._requests and not wire._sent  # (finished requests leave both sides)
    assert not direct or not twin.has_unfinished_requests()


def test_a_record_for_a_request_aborted_here_is_dropped():
    """The server aborts a request (its side forgets it) while the engine's next record for it is
    on its way: that record rebuilds nothing (it used to raise KeyError in the event loop's
    reader, found by a disconnect test); a new request of that id starts afresh with its head."""
    mirror = OutputMirror()
    head = ("r", ("hi", [1, 2]), False, None, None, [(0, "a", [5], None, None, None, None)], None)
    assert mirror.decode(head).outputs[0].text == "a"
    mirror.forget("r")
    assert mirror.decode(("r", None, False, None, None, [(0, "b", [6], None, None, None, None)], None)) is None
    assert mirror.decode(head).outputs[0].token_ids == [5]


@pytest.fixture(scope="module")
def process_client(tiny_gguf):
    """The tiny model in an engine process, with async scheduling (as the GPU check serves it)."""
    client = EngineProcessClient(EngineArgs(model=str(tiny_gguf["llama"][0]), dtype="float32",
                                            async_scheduling=True))
    yield client
    client.close()


def test_the_engine_process_answers_as_the_engine_in_process(process_client, tiny_gguf):
    """Greedy and seeded sampled streams equal `LLM.generate`'s (in order, in this process), and
    one stopped by a stop token id (whose text, made on this side, leaves the token out as the
    engine's does), streamed and final-only (one output); the engine's refusals arrive as the same `InvalidRequest`, with their field;
    tracing is refused naming the flag; the client has every member the server uses
    (`EngineClient`)."""
    client = process_client
    assert isinstance(client, EngineClient)
    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32")
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=11, n=2, max_tokens=12, logprobs=1, ignore_eos=True)]
    want = [llm.generate("the cat sat on", p)[0] for p in params]
    stop = want[0].outputs[0].token_ids[2]  # (the greedy answer's third token ends this one)
    params.append(SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop]))
    want.append(llm.generate("the cat sat on", params[-1])[0])
    assert want[-1].outputs[0].finish_reason == "stop" and want[-1].outputs[0].token_ids[-1] == stop
    want += [want[0], want[2]]

    async def main():
        got = []
        for p in params:
            last = None
            async for out in client.generate("the cat sat on", p):
                last = out
            got.append(last)
        for p in (params[0], params[2]):  # final-only (a request not streamed): its text made in one decode here
            rid = await client.add_request("the cat sat on", p, options=RequestOptions(final_only=True))
            outs = [out async for out in client.stream(rid)]
            assert len(outs) == 1
            got.append(outs[0])
        with pytest.raises(InvalidRequest) as e:  # refused in the engine process, raised here
            await client.unload_lora(7)
        assert e.value.field == "lora_name"
        # (still running when the second add arrives; greedy: sampled bytes could leave a 3-token text
        # pending, an unfinished UTF-8 sequence, as it did once in a clean-clone run)
        long = SamplingParams(temperature=0, max_tokens=250, ignore_eos=True)
        rid = await client.add_request("hi", long, request_id="taken")
        with pytest.raises(InvalidRequest) as e:
            await client.add_request("hi", long, request_id="taken")
        assert e.value.field == "request_id" and "already in use" in str(e.value)
        async for out in client.stream(rid):  # (the refused duplicate left the first one's text alone)
            if len(out.outputs[0].token_ids) >= 3:
                assert out.outputs[0].text
                break  # (aborts it)
        with pytest.raises(InvalidRequest):  # (refused in the engine process: nothing is left expected here)
            await client.add_request("hi " * 5000, SamplingParams(max_tokens=2))
        assert not client._mirror._expected
        with pytest.raises(InvalidRequest, match="--engine-process"):
            await client.add_request("hi", SamplingParams(max_tokens=2), options=RequestOptions(tracer=object()))
        for _ in range(200):  # the abort reaches the engine process, its counts come back
            stats = client.scheduler_stats()
            if stats.running == 0:
                break
            await asyncio.sleep(0.01)
        assert stats.running == stats.waiting == 0 and stats.free_blocks == stats.num_blocks
        assert stats.num_aborted == 1
        assert not client._mirror._requests  # (finished and aborted requests leave the server's side)
        return got

    got = asyncio.run(main())
    for g, w in zip(got, want):
        assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in g.outputs] == \
               [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in w.outputs]
    with pytest.raises(EngineError, match="--engine-process"):
        client.view()


def test_an_engine_process_that_dies_fails_its_streams_and_says_so(tiny_gguf):
    """The engine process killed mid-stream: the stream raises `EngineError`, `on_dead` is told
    (the server then exits 1), and a new request is refused at once."""
    client = EngineProcessClient(EngineArgs(model=str(tiny_gguf["llama"][0]), dtype="float32"))
    told = []
    client.on_dead = told.append

    async def main():
        with pytest.raises(EngineError, match="engine"):
            async for _ in client.generate("the cat", SamplingParams(temperature=0, max_tokens=250,
                                                                     ignore_eos=True)):
                os.kill(client.process.pid, signal.SIGKILL)
        with pytest.raises(EngineError):
            await client.add_request("the cat", SamplingParams(max_tokens=2))
        assert not client.is_running  # (what /health asks)

    try:
        asyncio.run(main())
        assert len(told) == 1 and "exit code -9" in str(told[0])
    finally:
        client.close()


def test_a_model_that_cannot_load_stops_the_start_with_its_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file")
    with pytest.raises(ModelLoadError):
        EngineProcessClient(EngineArgs(model=str(bad)))


@pytest.mark.subprocess
def test_a_program_that_exits_without_closing_the_client_does_not_hang(tiny_gguf, tmp_path):
    """The engine process ignores SIGTERM (the server drains first), so at exit multiprocessing
    would wait for it forever; the client closes its pipe at exit and the engine process ends."""
    import subprocess
    import sys

    script = tmp_path / "leave.py"
    script.write_text("from nextoken.engine.core_client import EngineProcessClient\n"
                      "from nextoken.engine_args import EngineArgs\n"
                      "if __name__ == '__main__':\n"
                      f"    c = EngineProcessClient(EngineArgs(model={str(tiny_gguf['llama'][0])!r}, dtype='float32'))\n"
                      "    print(c.process.pid, flush=True)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert not os.path.exists(f"/proc/{int(out.stdout)}")


def test_an_adapter_loads_and_serves_in_the_engine_process(tiny_gguf):
    """`load_lora` over the pipe: the adapter (llama.cpp's GGUF of the tiny model's adapter "a")
    loads in the engine process, a request with it gives the tokens it gives in this process,
    unloading works once, and a second unload is refused with the field."""
    from pathlib import Path

    from nextoken import LoRARequest

    path, lora = str(tiny_gguf["llama"][0]), str(Path(__file__).parents[1] / "data" / "lora-tiny-llama.gguf")
    req = LoRARequest("a-gguf", 1, lora)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = LLM(path, dtype="float32", enable_lora=True, max_lora_rank=8).generate(
        "the cat sat", params, lora_request=req)[0].outputs[0].token_ids
    base = LLM(path, dtype="float32").generate("the cat sat", params)[0].outputs[0].token_ids
    assert want != base  # (the adapter changes the answer: the comparison below means something)
    client = EngineProcessClient(EngineArgs(model=path, dtype="float32", enable_lora=True, max_lora_rank=8))

    async def main():
        lora_id = await client.load_lora(req)
        got = [out async for out in client.generate("the cat sat", params, options=RequestOptions(lora_request=req))]
        await client.unload_lora(lora_id)
        with pytest.raises(InvalidRequest) as e:
            await client.unload_lora(lora_id)
        assert e.value.field == "lora_name"
        return got[-1].outputs[0].token_ids

    try:
        assert asyncio.run(main()) == want
    finally:
        client.close()


async def _last_ids(client, prompt, params) -> list[int]:
    """The token ids of `client`'s generation of `prompt`, streamed to its end."""
    out = None
    async for out in client.generate(prompt, params):
        pass
    return out.outputs[0].token_ids


def _run_then_exit(process, main, *ends) -> None:
    """Run coroutine `main` against the engine process, close its front ends' `ends`, and see the
    process exit cleanly (killed if it outlives the test)."""
    try:
        asyncio.run(main)
        for end in ends:
            end.close()
        process.join(30)
        assert process.exitcode == 0
    finally:
        if process.is_alive():
            process.kill()


def test_a_front_end_that_stops_reading_holds_up_only_itself(tiny_gguf):
    """A server process whose event loop stops reading its pipe (busy, or stalled) while the
    engine process has two front ends: the other's requests still finish, equal to
    `LLM.generate`'s, though 4 x 200 steps' counts (about 700 bytes each) are more than the
    stalled pipe holds (64 KiB): the engine process sends each front end's messages from a thread
    of its own (`engine.core.Sender`). (With the step writing to the pipes itself, it waited on
    the full one after about 100 steps, and every request with it.) Once the stalled front end's
    pipes close, the engine process exits."""
    from nextoken.engine.core_client import start_engine_core

    path = str(tiny_gguf["llama"][0])
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    want = LLM(path, dtype="float32").generate("the cat", params)[0].outputs[0].token_ids
    process, channels = start_engine_core(EngineArgs(model=path, dtype="float32"), front_ends=2)
    (to_a, from_a), (to_b, from_b) = channels
    a = EngineProcessClient(None, channel=(to_a, from_a, process.pid))
    assert from_b.recv()[0] == "ready"  # the stalled front end: read once, then never again

    async def main():
        for _ in range(4):
            assert await _last_ids(a, "the cat", params) == want

    _run_then_exit(process, asyncio.wait_for(main(), 60), a, to_b, from_b)


def test_two_front_ends_each_get_their_own_requests_outputs(tiny_gguf):
    """One engine process with two front ends (``serve --api-server-count 2``): each front end's
    streams are its own requests', equal to `LLM.generate`'s while both run at once; each step's
    stats reach one front end only (the servers' metrics sum them), and the other once the first
    has closed; the engine process keeps serving the second, and exits when both have closed."""
    from nextoken.engine.core_client import start_engine_core

    path = str(tiny_gguf["llama"][0])
    prompts = ["the cat sat on", "a b c d", "hello there", "x y z"]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, dtype="float32").generate(prompts, params)]
    process, channels = start_engine_core(EngineArgs(model=path, dtype="float32"), front_ends=2)
    a, b = (EngineProcessClient(None, channel=(to, frm, process.pid)) for to, frm in channels)
    steps = {"a": 0, "b": 0}
    a.subscribe(lambda s: steps.__setitem__("a", steps["a"] + 1))
    b.subscribe(lambda s: steps.__setitem__("b", steps["b"] + 1))

    async def main():
        got = await asyncio.gather(*(_last_ids(c, p, params) for c, p in zip([a, b, a, b], prompts)))  # (same steps)
        assert got == want
        assert steps["a"] > 0 and steps["b"] == 0
        a.close()
        assert await _last_ids(b, prompts[1], params) == want[1]
        assert steps["b"] > 0 and process.is_alive()

    _run_then_exit(process, main(), b)


def test_a_fault_in_handling_a_message_is_not_the_engine_process_ending(tiny_gguf, caplog):
    """A step's subscriber that raises an OSError (as a metrics file's write might) is logged, and
    the client goes on: its stream ends as `LLM.generate`'s, the engine is still running. (The
    client took any OSError while handling a message for its pipe's end and failed every stream
    of its server process. On the H200, 2026-11-30, one of four server processes said the engine
    process had exited while it ran on; which error that was, its log did not say: it now does.)"""
    path = str(tiny_gguf["llama"][0])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = LLM(path, dtype="float32").generate(["the cat sat on"], params)[0].outputs[0].token_ids
    client = EngineProcessClient(EngineArgs(model=path, dtype="float32"))

    def broken(stats):
        raise BrokenPipeError(32, "Broken pipe")

    client.subscribe(broken)

    async def main():
        assert await _last_ids(client, "the cat sat on", params) == want
        assert client.is_running and client.dead is None

    try:
        asyncio.run(main())
        assert "could not be handled" in caplog.text and "BrokenPipeError" in caplog.text
    finally:
        client.close()


def test_text_made_by_the_front_end_shows_in_the_inspectors_recent_requests(tiny_gguf):
    """A request whose text its server process makes (``detokenize=False``) leaves none in the
    engine: the inspector's recent requests (`StepHistory`) keep its ids, and the live state
    shows them decoded, the text the same request has with the engine's text."""
    from nextoken.engine.view import EngineView
    from nextoken.inspect.engine_view import live_state

    path = str(tiny_gguf["llama"][0])
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    engine = LLM(path, dtype="float32").engine
    want = engine.run_until_finished([engine.add_request("the cat sat", params, "with-text")])[0].outputs[0].text
    engine.run_until_finished([engine.add_request("the cat sat", params, "ids-alone",
                                                  RequestOptions(detokenize=False))])
    kept = {r["request_id"]: r for r in engine.history.requests}
    assert kept["ids-alone"]["outputs"][0]["text"] is None and kept["with-text"]["outputs"][0]["text"] == want
    shown = {r["request_id"]: r for r in live_state(EngineView(engine))["requests"]}
    assert want and shown["ids-alone"]["outputs"][0]["text"] == shown["with-text"]["outputs"][0]["text"] == want


def test_the_mirror_expects_an_id_once():
    """`OutputMirror.expect` notes a request id it does not know, and not one it knows (expected,
    or with records on their way: the engine refuses that add), so a refused duplicate's
    `unexpect` never takes the first request's text away."""
    mirror = OutputMirror()
    first, second = SamplingParams(max_tokens=3), SamplingParams(max_tokens=4)
    assert mirror.expect("a", first) and not mirror.expect("a", second)
    mirror.unexpect("b")
    assert mirror._expected == {"a": (first, False)}
    mirror.decode(("a", ("p", [1]), False, None, None, [], None))  # (its head: now known by its records)
    assert not mirror._expected and not mirror.expect("a", second)
    mirror.forget("a")
    assert mirror.expect("a", second)


def test_the_pipe_reads_whole_messages_under_uvloop(tiny_gguf):
    """Under uvloop (uvicorn's loop wherever it is installed), whose ``add_reader`` makes the pipe
    non-blocking (libuv's poll), a step message larger than the pipe's buffer (four prompts'
    log-probabilities from one prefill step, some 200 KiB pickled) arrives whole: the reader took
    the first ``EAGAIN`` for the engine process's end, and a server process failed every stream it
    had (the H200's serving run of 2026-11-30)."""
    import uvloop

    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=20, ignore_eos=True)
    prompts = [list(range(3 + k, 240 + k)) for k in range(4)]
    want = llm.generate(prompts, params)
    client = EngineProcessClient(EngineArgs(model=str(tiny_gguf["llama"][0]), dtype="float32"))
    try:
        async def one(prompt):
            last = None
            async for out in client.generate(prompt, params):
                last = out
            return last

        async def main():
            return await asyncio.gather(*(one(p) for p in prompts))

        loop = uvloop.new_event_loop()  # (asyncio.Runner's loop_factory: Python 3.11)
        try:
            got = loop.run_until_complete(main())
        finally:
            loop.close()
        assert len(pickle.dumps([g.prompt_logprobs for g in got])) > 1 << 17
        assert [g.prompt_logprobs for g in got] == [w.prompt_logprobs for w in want]
        assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want] and client.dead is None
    finally:
        client.close()
