"""``nextoken run-batch``: OpenAI batch files answered offline through the server's own app, as
vLLM's ``run-batch``: the same answers as the server gives, in the input's order, each bad line
named and the others answered."""

from __future__ import annotations

import json

from nextoken import LLM, SamplingParams
from nextoken import cli

CHAT = {"messages": [{"role": "user", "content": "the cat"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True}


def request(custom_id: str, url: str, body: dict, **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra})


def run(tmp_path, lines: list[str], *flags) -> list[dict]:
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    assert cli.main(["run-batch", "-i", str(src), "-o", str(dst), *flags]) == 0
    return [json.loads(line) for line in dst.read_text().splitlines()]


def test_a_batch_file_is_answered_as_the_server_answers(tiny_gguf, tmp_path):
    path = str(tiny_gguf["llama"][0])
    lines = [request("chat", "/v1/chat/completions", {"model": "tiny", **CHAT}),
             request("text", "/v1/completions", {"model": "tiny", "prompt": [5, 17, 200], "max_tokens": 4,
                                                  "temperature": 0}),
             request("empty", "/v1/chat/completions", {"model": "tiny", "messages": []}),
             request("other", "/v1/chat/completions", {"model": "gpt-4o", **CHAT}),
             "{not json", "",
             request("get", "/v1/models", {}, method="GET"),
             request("streamed", "/v1/chat/completions", {"model": "tiny", "stream": True, **CHAT})]
    out = run(tmp_path, lines, "--model", path, "--dtype", "float32", "--served-model-name", "tiny")
    assert [r["custom_id"] for r in out] == ["chat", "text", "empty", "other", None, "get", "streamed"]
    llm = LLM(path, dtype="float32")
    want = llm.chat(CHAT["messages"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].outputs[0].text
    assert out[0]["response"]["status_code"] == 200
    assert out[0]["response"]["body"]["choices"][0]["message"]["content"] == want
    text = llm.generate([5, 17, 200], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].text
    assert out[1]["response"]["body"]["choices"][0]["text"] == text
    assert out[2]["response"]["status_code"] == 400 and out[2]["response"]["body"]["error"]["param"] == "messages"
    assert out[3]["response"]["status_code"] == 404 and "'tiny'" in out[3]["response"]["body"]["error"]["message"]
    assert out[4]["error"]["message"].startswith("line 5 is not JSON") and out[4]["response"] is None
    assert "batch requests are POST" in out[5]["error"]["message"]
    assert "cannot stream" in out[6]["error"]["message"]
    assert len({r["id"] for r in out}) == len(out)


def test_an_embedding_model_answers_embedding_lines(tmp_path):
    from nextoken.catalog import pull

    path = str(pull("all-minilm-l6-v2", progress=False))
    texts = ["a cat", "a kitten sleeps"]
    out = run(tmp_path, [request(t, "/v1/embeddings", {"input": t}) for t in texts], "--model", path, "--dtype", "float32")
    want = [o.outputs.embedding for o in LLM(path, dtype="float32").embed(texts)]
    got = [r["response"]["body"]["data"][0]["embedding"] for r in out]
    assert all(abs(a - b) < 1e-5 for g, w in zip(got, want) for a, b in zip(g, w))
