"""The chat core (`server.chat.core.prepare`, `server.chat.run.run`) driven directly with a fake
`engine.protocol.EngineClient`: the core needs nothing of an engine but the declared members,
and what it hands the engine and makes of the engine's outputs follows from the request alone."""

from __future__ import annotations

import asyncio
import json

import pytest

from nextoken.engine.async_engine import AsyncLLMEngine
from nextoken.engine.protocol import EngineClient, Service
from nextoken.errors import InvalidRequest
from nextoken.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nextoken.server.args import ServerArgs
from nextoken.sampling_params import SamplingParams
from nextoken.server.chat.core import ChatSpec, Prepared, prepare
from nextoken.server.chat.events import Finish, Text, ToolCallArgs, ToolCallStart
from nextoken.server.chat.run import ChatResult, EventStream, run
from nextoken.server.api.serving import ApiServing
from nextoken.server.api.state import ServerState


class FakeEngine:
    """Only `EngineClient`'s members: a real tokenizer and config, a scripted answer streamed in
    `pieces`, and a record of what the core asked."""

    def __init__(self, tokenizer, config, pieces: list[str], max_model_len: int = 2048):
        self.tokenizer, self.config, self.max_model_len = tokenizer, config, max_model_len
        self.kv_capacity, self.watermark, self.model_path = 4096, None, "fake"
        self.sampling_defaults: dict = {}
        self.max_logprobs = 20
        self.pieces, self.added, self.compiled, self.aborted = pieces, [], [], []
        self.is_running, self.dead, self.num_waiting = True, None, 0

    async def add_request(self, prompt, params=None, request_id=None, options=None) -> str:
        self.added.append((request_id, prompt, params))
        return request_id

    async def stream(self, rid):
        text, ids = "", []
        for k, piece in enumerate(self.pieces):
            last = k == len(self.pieces) - 1
            new = self.tokenizer.encode(piece, add_bos=False)
            text, ids = text + piece, ids + new
            out = CompletionOutput(0, text=text, delta=piece, token_ids=list(ids), delta_token_ids=new,
                                   finish_reason="stop" if last else None)
            metrics = RequestMetrics(arrival_time=0.0, num_prompt_tokens=len(self.added[-1][1]),
                                     num_output_tokens=len(ids), first_token_time=0.1,
                                     finished_time=0.2 if last else None)
            yield RequestOutput(rid, None, self.added[-1][1], [out], finished=last, metrics=metrics)

    def generate(self, prompt, params=None, request_id=None, options=None):
        raise NotImplementedError

    def abort(self, request_id):
        self.aborted.append(request_id)

    async def beam_search(self, prompt_ids, search, request_id=None, options=None):
        raise NotImplementedError

    def compile_grammar(self, structured):
        self.compiled.append(structured)

    def encode_prompt(self, prompt, params, truncate=False):
        return list(prompt)

    def scheduler_stats(self):
        return None

    def subscribe(self, subscriber):
        pass

    def view(self):
        raise NotImplementedError

    async def between_steps(self, fn):
        return fn()

    async def load_lora(self, lora_request):
        return 1

    async def unload_lora(self, lora_id):
        pass

    def close(self):
        pass


class Connected:
    """A request whose client stays connected (what `ApiServing.collect` asks)."""

    async def is_disconnected(self) -> bool:
        return False


class Metrics:
    def __init__(self):
        self.seen = []

    def observe(self, out):
        self.seen.append(out)


def serving_with(engine) -> ApiServing:
    return ApiServing(ServerState(engine=engine), ServerArgs(model_name="m", max_tokens_default=64), Metrics())


@pytest.fixture(scope="module")
def tok_config(smollm2_llm):
    return smollm2_llm.engine.tokenizer, smollm2_llm.engine.config


def test_the_engines_implement_the_declared_protocols(smollm2_llm):
    """`AsyncLLMEngine` has every member `EngineClient` declares (so the server never needs the
    `LLMEngine` inside), and so has the fake here; a plain object has not."""
    assert isinstance(AsyncLLMEngine(smollm2_llm.engine), EngineClient)
    assert isinstance(FakeEngine(None, None, []), EngineClient)
    assert not isinstance(object(), Service) and not isinstance(object(), EngineClient)
    from nextoken.engine.protocol import PoolingClient
    from nextoken.server.pooling.serving import EmbeddingService

    service = EmbeddingService(model=None)  # (the pass loop waits for work; closed below)
    try:
        assert isinstance(service, PoolingClient) and not isinstance(AsyncLLMEngine(smollm2_llm.engine), PoolingClient)
    finally:
        service.close()


def test_prepare_renders_the_template_and_bounds_max_tokens(tok_config):
    """The prompt ids are the tokenizer's chat template over the messages; with no max_tokens the
    bound is the server's default (64 here, under the context's room); a max_tokens that leaves
    no room for the prompt is refused naming the request's own field; the grammar of an output
    format is compiled before the request is queued."""
    tok, cfg = tok_config
    eng = FakeEngine(tok, cfg, [])
    msgs = [{"role": "user", "content": "Name a colour."}]
    prep = asyncio.run(prepare(serving_with(eng), ChatSpec(msgs)))
    text = tok.decode(prep.ids)
    assert "<|im_start|>user\nName a colour.<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert prep.params.max_tokens == 64 and prep.tools is None
    with pytest.raises(InvalidRequest) as e:
        asyncio.run(prepare(serving_with(eng), ChatSpec(msgs, max_tokens=2048, fields={"max_tokens": "max_completion_tokens"})))
    assert e.value.field == "max_completion_tokens" and "2048" in str(e.value)
    from nextoken.structured.params import StructuredOutputsParams
    fmt = StructuredOutputsParams(json={"type": "object"})
    asyncio.run(prepare(serving_with(eng), ChatSpec(msgs, constraint=fmt)))
    assert eng.compiled == [fmt]


def test_run_parses_the_engines_answer_streamed_and_not(tok_config):
    """`run` queues the prepared ids and params as one request, and the same scripted answer
    (text, then a tagged tool call) comes back as one `ChatResult` and, streamed, as events whose
    text and call arguments join to the same; each finished request is recorded once."""
    tok, cfg = tok_config
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    pieces = ["Let me check. ", call[:20], call[20:]]
    prep = Prepared(tok.encode("Weather in Paris?"), SamplingParams(max_tokens=64), None, frozenset({"get_weather"}))

    async def both():
        eng = FakeEngine(tok, cfg, pieces)
        serving = serving_with(eng)
        res = await run(serving, prep, request=Connected())
        assert eng.added[0][1] == prep.ids and eng.added[0][2] is prep.params and eng.added[0][0].startswith("chatcmpl-")
        stream = await run(serving, prep, request=None, stream=True)
        events = [ev async for ev in stream]
        return res, stream, events, serving.metrics.seen

    res, stream, events, seen = asyncio.run(both())
    assert isinstance(res, ChatResult) and isinstance(stream, EventStream)
    (choice,) = res.choices
    assert choice.text.strip() == "Let me check." and [(c.name, json.loads(c.arguments)) for c in choice.calls] == \
        [("get_weather", {"city": "Paris"})] and choice.finish == "tool_calls"
    text = "".join(ev.text for ev in events if isinstance(ev, Text))
    starts = [ev for ev in events if isinstance(ev, ToolCallStart)]
    args = "".join(ev.text for ev in events if isinstance(ev, ToolCallArgs))
    assert text.strip() == "Let me check." and [s.name for s in starts] == ["get_weather"]
    assert json.loads(args) == {"city": "Paris"}
    (fin,) = [ev for ev in events if isinstance(ev, Finish)]
    assert fin.choice.finish == "tool_calls"
    assert len(seen) == 2  # one record per request: the unstreamed and the streamed one


def test_a_call_begun_and_cut_in_the_last_step_streams_without_failing(tok_config):
    """A step that both begins a call and ends at the token limit inside it (speculative
    decoding, or a burst of tokens, brings several per step): the stream names the call it began,
    then finishes with the length reason and no calls, as the unstreamed answer; it used to end in
    `Failed` (the cut call was gone from the parser's calls before its start was sent)."""
    from tests.server.test_tool_loop import ScriptedEngine
    tok, cfg = tok_config
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": '
    prep = Prepared(tok.encode("q"), SamplingParams(max_tokens=64), None, frozenset({"get_weather"}))

    async def go():
        serving = serving_with(ScriptedEngine(tok, cfg, [(["Checking. ", cut], "length")]))
        return [ev async for ev in await run(serving, prep, request=None, stream=True)]

    events = asyncio.run(go())
    assert not [e for e in events if type(e).__name__ == "Failed"]
    assert [e.name for e in events if isinstance(e, ToolCallStart)] == ["get_weather"]
    (fin,) = [e for e in events if isinstance(e, Finish)]
    assert fin.choice.finish == "length" and fin.choice.calls == [] and fin.choice.text.strip() == "Checking."
