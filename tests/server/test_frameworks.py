"""Frameworks people build on these APIs, unchanged, against a live server: OpenAI's Agents SDK
on the Responses API (a function tool round trip: the model calls, the SDK runs the Python
function, sends its output back, the model answers) and LiteLLM, a gateway, through its Ollama
chat provider (which posts JSON without a Content-Type header) and its OpenAI provider. Their
requests as they send them; the tiny model is forced to call where a call is the point."""

from __future__ import annotations

from pathlib import Path

import pytest

from nextoken import LLM
from tests.helpers.server import LiveServer

TEMPLATE = Path(__file__).parents[1] / "data" / "chatml_tools.jinja"


@pytest.fixture(scope="module")
def srv(tiny_gguf, tmp_path_factory):
    from tests.tiny_models import write_gguf

    path = tmp_path_factory.mktemp("frameworks") / "tiny-long.gguf"  # room for the SDKs' tool schemas
    write_gguf(tiny_gguf["llama"][1], path, "llama", context_length=2048)
    s = LiveServer(LLM(str(path), dtype="float32", chat_template=str(TEMPLATE)), "tiny")
    yield s
    s.stop()


def weather_agent(url: str, model_name: str, **settings):
    """An Agents SDK agent with one function tool on our Responses API; (agent, cities seen)."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"21 C in {city}"

    model = OpenAIResponsesModel(model_name, AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0))
    settings = {"temperature": 0, **settings}
    behaviour = settings.pop("tool_use_behavior", "run_llm_again")
    return Agent(name="weather", instructions="You answer questions about the weather with the get_weather tool.",
                 tools=[get_weather], model=model,
                 model_settings=ModelSettings(**settings), tool_use_behavior=behaviour), seen


def test_openai_agents_sdk_calls_a_function_tool(srv):
    """The SDK's request as it sends it (``include: []``, ``strict: true`` tools, ...): the forced
    call comes back as its tool call, the SDK runs the function. (The random model never ends an
    answer, so the run stops at the tool's output; the whole round trip is the Qwen test.)"""
    import asyncio

    from agents import Runner

    agent, seen = weather_agent(srv.url, "tiny", tool_choice="required", max_tokens=120,
                                tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(Runner.run(agent, "Weather in Paris?", max_turns=2))
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and len(seen) == 1, kinds
    assert result.final_output == f"21 C in {seen[0]}"


@pytest.mark.slow
def test_openai_agents_sdk_round_trip_on_qwen():
    """Qwen2.5-Coder-0.5B through the Agents SDK: it calls the tool, the SDK sends the output
    back (function_call_output, with the call, as input items) and the model's next answer ends
    the run. (What the 0.5B model says then is its business: with the SDK's tool schema it tends
    to echo the call rather than use the result; the MCP test has it answer with the output.)"""
    import asyncio

    from agents import Runner

    from nextoken.catalog import pull

    s = LiveServer(LLM(str(pull("qwen2.5-coder-0.5b-instruct", progress=False))), "qwen")
    try:
        agent, seen = weather_agent(s.url, "qwen", max_tokens=80)
        result = asyncio.run(Runner.run(agent, "What is the weather in Paris? Use the tool.", max_turns=4))
        assert len(seen) == 1 and seen[0].lower().startswith("paris")
        kinds = [item.type for item in result.new_items]
        assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item", kinds
        assert isinstance(result.final_output, str) and result.final_output
    finally:
        s.stop()


def test_litellm_ollama_and_openai_providers(srv):
    import litellm

    msgs = [{"role": "user", "content": "the cat"}]
    r = litellm.completion(model="ollama_chat/tiny", api_base=srv.url, messages=msgs, max_tokens=4, temperature=0)
    assert r.choices[0].message.content is not None and r.usage.completion_tokens <= 4
    r = litellm.completion(model="openai/tiny", api_base=srv.url + "/v1", api_key="none", messages=msgs,
                           max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 4
    stream = litellm.completion(model="ollama_chat/tiny", api_base=srv.url, messages=msgs, max_tokens=4, stream=True)
    assert sum(1 for _ in stream) >= 1
