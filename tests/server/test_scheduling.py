"""Scheduling through the server: the ``priority`` field on every API (as vLLM's OpenAI bodies
have it), refused by a server that does not schedule by priority, the queue time per priority in
``/metrics``, and the keep-alive that outlives the clients' connection pools."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from nextoken import LLM
from nextoken.server.args import ServerArgs
from tests.helpers.server import LiveServer


@pytest.fixture(scope="module")
def priority_server(smollm2_path):
    llm = LLM(str(smollm2_path), max_num_seqs=2, scheduling_policy="priority")
    srv = LiveServer(llm, "smol")
    yield srv
    srv.server.should_exit = True
    srv.thread.join(timeout=10)
    llm.close()


def ask_every_api(srv, priority: int, model: str = "smol") -> list:
    """The same short question with `priority`, through the openai and anthropic SDKs and
    Ollama's chat route; returns what each answered (an exception for a refusal)."""
    import anthropic  # where used: the SDK takes seconds to import, and every worker collects this module

    got = []
    try:
        got.append(srv.client().chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body={"priority": priority}))
    except openai.BadRequestError as exc:
        got.append(exc)
    try:
        got.append(srv.client().completions.create(model=model, prompt="Hi", max_tokens=2,
                                                   extra_body={"priority": priority}))
    except openai.BadRequestError as exc:
        got.append(exc)
    try:
        got.append(anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0).messages.create(
            model=model, max_tokens=2, messages=[{"role": "user", "content": "Hi"}], extra_body={"priority": priority}))
    except anthropic.BadRequestError as exc:
        got.append(exc)
    r = httpx.post(srv.url + "/api/chat", json={"model": model, "stream": False, "messages": [
        {"role": "user", "content": "Hi"}], "options": {"num_predict": 2, "priority": priority}})
    got.append(r)
    return got


def test_priority_is_taken_by_every_api_under_the_priority_policy(priority_server):
    oa_chat, oa_cmpl, an, ol = ask_every_api(priority_server, -3)
    assert oa_chat.choices[0].message.content is not None and oa_cmpl.choices[0].text is not None
    assert an.content and ol.status_code == 200, ol.text
    metrics = httpx.get(priority_server.url + "/metrics").text
    assert 'nextoken_request_queue_time_seconds_count{priority="-3"} 4.0' in metrics


def test_priority_is_refused_without_the_priority_policy(smollm2_server):
    """A server scheduling first come, first served refuses a priority other than 0 on every API,
    naming the field (its Ollama name for Ollama), as vLLM does; 0 is fine."""
    import anthropic

    oa_chat, oa_cmpl, an, ol = ask_every_api(smollm2_server, 5, "smollm2")
    for exc in (oa_chat, oa_cmpl):
        assert isinstance(exc, openai.BadRequestError) and exc.body["param"] == "priority"
        assert "--scheduling-policy priority" in exc.body["message"]
    assert isinstance(an, anthropic.BadRequestError) and "priority" in str(an)
    assert ol.status_code == 400 and "priority" in ol.json()["error"]
    assert all(not isinstance(x, Exception) and getattr(x, "status_code", 200) == 200
               for x in ask_every_api(smollm2_server, 0, "smollm2"))


def local_port(response: httpx.Response) -> int:
    return response.extensions["network_stream"].get_extra_info("client_addr")[1]


def test_keep_alive_outlives_the_clients_pool(smollm2_llm):
    """The race behind a client's ReadError: httpx (and the openai SDK over it) keeps an idle
    connection 5 s, uvicorn's default closes it after 5 s, so a request sent as the server closes
    it fails. `serve` keeps connections 75 s: a connection idle for longer than a short server
    keep-alive is reused, where a server with a keep-alive shorter than the idle time (0.5 s here,
    for 5 s) has closed it and the client must reconnect."""
    assert ServerArgs().timeout_keep_alive > httpx.Limits().keepalive_expiry
    ports = {}
    for keep_alive in (0.5, ServerArgs().timeout_keep_alive):
        srv = LiveServer(smollm2_llm, "smol", timeout_keep_alive=keep_alive)
        try:
            with httpx.Client(base_url=srv.url) as client:
                first = local_port(client.get("/health"))
                time.sleep(1.0)
                ports[keep_alive] = (first, local_port(client.get("/health")))
        finally:
            srv.server.should_exit = True
            srv.thread.join(timeout=10)
    short, default = ports[0.5], ports[ServerArgs().timeout_keep_alive]
    assert short[0] != short[1]  # closed by the server: a new connection
    assert default[0] == default[1]  # the same connection, reused
