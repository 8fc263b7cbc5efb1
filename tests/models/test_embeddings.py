"""Embeddings: the BERT encoder against `transformers` on a tiny random config, the catalog's
all-MiniLM-L6-v2 against `sentence-transformers`, pooling and batching, bad inputs, and the HTTP
API through the openai client."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from nextoken.errors import InvalidRequest

SENTENCES = [
    "The cat sits on the mat.", "A quick brown fox jumps over the lazy dog.", "Inference engines batch requests.",
    "Paged attention stores keys and values in blocks.", "Where is the nearest train station?",
    "I love programming in Python.", "The weather today is sunny and warm.", "Quantum computers use qubits.",
    "She sells sea shells by the sea shore.", "Transformers changed natural language processing.",
    "How do I bake sourdough bread?", "The stock market fell sharply on Monday.", "Cats are independent animals.",
    "Speculative decoding drafts tokens with a smaller model.", "Please close the door behind you.",
    "A", "Machine learning models need data.", "The museum opens at nine in the morning.",
    "Rust and C are systems programming languages.", "Embeddings map text to vectors of numbers. " * 3,
]


@pytest.fixture(scope="module")
def minilm():
    """all-MiniLM-L6-v2 from the catalog, as an `LLM` (embedding-only), in float32: the reference."""
    from nextoken import LLM

    return LLM("all-minilm-l6-v2", dtype="float32")


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A tiny random BERT saved by `transformers` (safetensors), with a WordPiece tokenizer and a
    sentence-transformers pooling config: (folder, the transformers model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=48, max_position_embeddings=40)
    model = BertModel(cfg, add_pooling_layer=False).eval()
    d = tmp_path_factory.mktemp("tiny-bert")
    model.save_pretrained(d, safe_serialization=True)
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + [chr(97 + i) for i in range(26)]
                                        + [f"w{i}" for i in range(34)])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2),
                                                                                                ("[SEP]", 3)])
    tok.save(str(d / "tokenizer.json"))
    (d / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (d / "1_Pooling").mkdir()
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return d, model


@pytest.mark.parametrize("c_kernels", [False, True])
def test_the_encoder_equals_transformers_on_packed_sequences(tiny_bert, c_kernels):
    """Three sequences packed into one pass equal `transformers`' BertModel run on each alone
    (float32, 1e-5): bidirectional attention within each sequence, positions from 0 in each; the
    same through PyTorch (the reference path) and through the C attention and add + norm
    (kernels/encoder.c, what the execution plan binds)."""
    from nextoken.kernels import load
    from nextoken.loader.hf import HFModelDir
    from nextoken.models.bert import BertModel

    d, ref = tiny_bert
    ours = BertModel.from_dir(HFModelDir(d))
    ours.kernel = load("encoder") if c_kernels else None
    assert (ours.kernel is not None) == c_kernels
    seqs = [[2, 5, 9, 3], [2, 40, 41, 42, 43, 44, 45, 3], [2, 7, 3]]
    packed = ours(torch.tensor([t for s in seqs for t in s]), [len(s) for s in seqs])
    at = 0
    for s in seqs:
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([s])).last_hidden_state[0]
        assert torch.allclose(packed[at : at + len(s)], want, atol=1e-5), (packed[at : at + len(s)] - want).abs().max()
        at += len(s)


def test_the_encoder_on_the_gpu_path_names_every_device(tiny_bert):
    """The encoder on its device (a GPU when the check runs there: ``TRITON_INTERPRET=0``; here
    the CPU), with PyTorch's default device set to meta, so any tensor made without its device
    fails: the same float32 vectors as the CPU's encoder."""
    import os

    from nextoken.embedding import EmbeddingModel

    d, _ = tiny_bert
    gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0"
    device = torch.device("cuda" if gpu else "cpu")
    texts = ["a b c", "w1 w2 w3 w4 w5 w6", "z"]
    want = EmbeddingModel(d).embed(texts).vectors
    model = EmbeddingModel(d, device=device)
    with torch.device("meta"):
        got = model.embed(texts).vectors
    assert got.device.type == "cpu" and (got - want).abs().max() < 1e-5


def test_the_encoder_runs_the_execution_plans_kernels(minilm):
    """The encoder loads through the execution plan as a generation model does: its quantized
    linears hold the plan's encoder library for Q8_0 (the int8 GEMM) and its qmatmul library for
    another format (resolved once, `KernelSet`), its plan line says what runs, and enforce_eager
    (the plan without kernels) refuses a quantized encoder by name."""
    from nextoken.embedding import EmbeddingModel
    from nextoken.errors import ModelLoadError
    from nextoken.kernels import KernelSet

    d = minilm.model_path
    q = EmbeddingModel(d, dtype=torch.bfloat16, quantization="q8_0")
    assert q.plan.kernels == KernelSet.resolve() and q.encoder.lib is q.plan.kernels.encoder
    assert "24 codes (Q8_0, our kernel)" in q.describe()  # 6 layers x (fused qkv, o, up, down)
    q4 = EmbeddingModel(d, quantization="q4_0")
    assert q4.encoder.lib is q4.plan.kernels.qmatmul and "24 codes (Q4_0, our kernel)" in q4.describe()
    plain = EmbeddingModel(d)
    assert "dense (PyTorch)" in plain.describe() and "pooling: mean" in plain.describe()
    with pytest.raises(ModelLoadError, match="enforce_eager"):
        EmbeddingModel(d, dtype=torch.bfloat16, quantization="q8_0", enforce_eager=True)


@pytest.mark.parametrize("mode", ["mean", "cls", "last"])
def test_pooling_follows_the_folders_config(tiny_bert, tmp_path, mode):
    import shutil

    from nextoken.embedding import EmbeddingModel

    src, ref = tiny_bert
    d = tmp_path / "m"
    shutil.copytree(src, d)
    key = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "last": "pooling_mode_lasttoken"}[mode]
    (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": False, key: True}))
    model = EmbeddingModel(d)
    ids = model.tokenize(["a b c", "d"])
    out = model.embed(["a b c", "d"]).vectors
    for row, s in zip(out, ids):
        with torch.no_grad():
            h = ref(input_ids=torch.tensor([s])).last_hidden_state[0]
        want = {"mean": h.mean(0), "cls": h[0], "last": h[-1]}[mode]
        assert torch.allclose(row, want, atol=1e-5)


def test_minilm_equals_sentence_transformers(minilm):
    """20 sentences through `LLM.embed` and through sentence-transformers 6 on the same folder:
    cosine >= 0.9999 each (float32), and the same token counts."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(minilm.model_path, device="cpu")
    want = torch.from_numpy(st.encode(SENTENCES, batch_size=32))
    outs = minilm.embed(SENTENCES)
    got = torch.tensor([o.outputs.embedding for o in outs])
    cos = torch.nn.functional.cosine_similarity(got, want)
    assert cos.min() >= 0.9999, cos
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5)  # its Normalize module
    assert [len(o.prompt_token_ids) for o in outs] == [len(x) for x in st.tokenizer(SENTENCES)["input_ids"]]


def varied_sentences(n: int = 200) -> list[str]:
    """`n` texts of 1 to 6 of `SENTENCES` joined (each picked by a fixed rule): 2 to 150 tokens."""
    return [" ".join(SENTENCES[(i * 7 + j * 3) % len(SENTENCES)] for j in range(1 + i % 6)) for i in range(n)]


@pytest.fixture(scope="module")
def varied_float32(minilm) -> tuple[list[str], torch.Tensor]:
    """`varied_sentences` and their float32 embeddings ``[200, 384]`` (the reference of each fast encoder)."""
    texts = varied_sentences()
    return texts, torch.tensor([o.outputs.embedding for o in minilm.embed(texts)])


@pytest.mark.parametrize("dtype,quantization", [(torch.bfloat16, None), (torch.float32, "q8_0"),
                                                (torch.bfloat16, "q8_0")])
def test_fast_encoders_keep_cosine_and_nearest_neighbours(minilm, varied_float32, dtype, quantization):
    """The bf16 encoder (what ``dtype="auto"`` picks where the CPU multiplies bf16 in hardware)
    and the int8 one (``quantization="q8_0"``: its linears on our kernel) against float32 on 200
    texts of varied length: cosine >= 0.999 each, and each text's nearest neighbour the same, but
    where float32's two nearest are closer than the fast encoder's own error."""
    from nextoken.embedding import EmbeddingModel

    texts, f32 = varied_float32
    bf16 = EmbeddingModel(minilm.model_path, dtype=dtype, quantization=quantization).embed(texts).vectors.float()
    assert torch.nn.functional.cosine_similarity(bf16, f32).min() >= 0.999
    sim32, sim16 = f32 @ f32.T, bf16 @ bf16.T
    err = float((sim32 - sim16).abs().max())  # how far bf16 moves any similarity
    for s in (sim32, sim16):
        s.fill_diagonal_(-2.0)
        s[torch.tensor([[a == b for b in texts] for a in texts])] = -2.0  # (identical texts: no neighbour)
    top2 = sim32.topk(2, dim=1)
    same = sim32.argmax(1) == sim16.argmax(1)
    close = (top2.values[:, 0] - top2.values[:, 1]) <= 2 * err
    assert bool((same | close).all()) and float(same.float().mean()) >= 0.95, (err, int((~same).sum()))


def test_auto_dtype_is_bf16_only_where_the_cpu_multiplies_bf16(monkeypatch):
    import nextoken.kernels.cpu as cpu
    from nextoken.embedding import encoder_dtype

    monkeypatch.setattr(cpu, "_BF16_NATIVE", False)
    assert encoder_dtype("auto") == torch.float32 and encoder_dtype("bfloat16") == torch.bfloat16
    monkeypatch.setattr(cpu, "_BF16_NATIVE", True)
    assert encoder_dtype("auto") == torch.bfloat16 and encoder_dtype("float32") == torch.float32
    with pytest.raises(InvalidRequest, match="dtype"):
        encoder_dtype("float16")


def test_a_batch_equals_each_input_alone_and_token_ids_are_used_as_given(minilm):
    together = [o.outputs.embedding for o in minilm.embed(SENTENCES[:6])]
    for s, v in zip(SENTENCES[:6], together):
        assert np.allclose(minilm.embed(s)[0].outputs.embedding, v, atol=1e-6)
    ids = minilm.embed(SENTENCES[0])[0].prompt_token_ids
    assert np.allclose(minilm.embed(ids)[0].outputs.embedding, together[0], atol=1e-6)


def test_bad_inputs_are_named(minilm, smollm2_llm):
    for bad, field in (([""], "input"), ([], "input"), (["word " * 400], "input"), ([[1, 99999]], "input")):
        with pytest.raises(InvalidRequest) as e:
            minilm.embed(bad)
        assert e.value.field == field, bad
    with pytest.raises(InvalidRequest, match="256"):
        minilm.embed("word " * 400)
    assert len(minilm.embed("word " * 400, truncate=True)[0].prompt_token_ids) == 256
    full = minilm.embed("the cat sat on the mat by the door")[0].prompt_token_ids
    cut = minilm.embed("the cat sat on the mat by the door", truncate_prompt_tokens=6)[0]
    assert cut.prompt_token_ids == full[:5] + full[-1:]  # ([CLS] and four words, then [SEP], as vLLM cuts)
    assert np.allclose(cut.outputs.embedding, minilm.embed(full[:5] + full[-1:])[0].outputs.embedding, atol=1e-6)
    with pytest.raises(InvalidRequest, match="truncate_prompt_tokens"):
        minilm.embed("x", truncate_prompt_tokens=0)
    with pytest.raises(InvalidRequest, match="matryoshka") as e:
        minilm.embed("x", dimensions=128)
    assert e.value.field == "dimensions"
    with pytest.raises(InvalidRequest, match="generates text"):
        smollm2_llm.embed("x")
    with pytest.raises(InvalidRequest, match="embedding model"):
        minilm.generate("x")


@pytest.fixture(scope="module")
def embed_server(minilm):
    from tests.helpers.server import LiveServer

    srv = LiveServer(minilm, "minilm")
    yield srv
    srv.stop()


def test_the_openai_client_creates_embeddings(embed_server, minilm):
    client = embed_server.client()
    r = client.embeddings.create(model="minilm", input=SENTENCES[:3])
    want = [o.outputs.embedding for o in minilm.embed(SENTENCES[:3])]
    assert [d.index for d in r.data] == [0, 1, 2] and np.allclose([d.embedding for d in r.data], want, atol=1e-6)
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in minilm.embed(SENTENCES[:3]))
    raw = client.embeddings.create(model="minilm", input="The cat sits on the mat.", encoding_format="base64")
    vec = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4")  # asked for: left to the caller
    assert np.allclose(vec, want[0], atol=1e-6)


def test_the_ollama_client_embeds(embed_server, minilm):
    """Ollama's ``/api/embed`` and older ``/api/embeddings`` (LangChain's OllamaEmbeddings,
    LlamaIndex's, the ollama packages): the model's vectors, Ollama's counts, Ollama's error shape."""
    import httpx
    import ollama

    c = ollama.Client(host=embed_server.url)
    want = [o.outputs.embedding for o in minilm.embed(SENTENCES[:2])]
    r = c.embed(model="minilm:latest", input=SENTENCES[:2])
    assert np.allclose(r.embeddings, want, atol=1e-6) and r.model == "minilm"
    assert r.prompt_eval_count == sum(len(o.prompt_token_ids) for o in minilm.embed(SENTENCES[:2]))
    assert np.allclose(c.embed(model="minilm", input=SENTENCES[0]).embeddings, want[:1], atol=1e-6)
    assert np.allclose(c.embeddings(model="minilm", prompt=SENTENCES[1]).embedding, want[1], atol=1e-6)
    bad = httpx.post(embed_server.url + "/api/embed", json={"model": "nope", "input": "hi"})
    assert bad.status_code == 404 and set(bad.json()) == {"error"}
    with pytest.raises(ollama.ResponseError):
        c.embed(model="minilm", input=[])


def test_embeddings_over_http_take_every_input_form_and_refuse_bad_ones(embed_server):
    import httpx

    url = embed_server.url
    ids = embed_server.llm.embed("hello world")[0].prompt_token_ids
    for body in ({"input": "hello world"}, {"input": ["hello world"]}, {"input": ids}, {"input": [ids]}):
        r = httpx.post(url + "/v1/embeddings", json=body)
        assert r.status_code == 200 and len(r.json()["data"]) == 1, r.text
    r = httpx.post(url + "/v1/embeddings", json={"input": "hi", "encoding_format": "base64"})
    vec = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    assert vec.shape == (384,) and abs(np.linalg.norm(vec) - 1) < 1e-5
    for body, param in (({"input": ""}, "input"), ({"input": "x " * 400}, "input"), ({"input": []}, "input"),
                        ({"input": "x", "dimensions": 64}, "dimensions"), ({"input": "x", "model": "other"}, "model")):
        r = httpx.post(url + "/v1/embeddings", json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (body, r.text)
    for k, n in ((256, 256), (-1, 256), (12, 12)):  # (-1: the model's length)
        r = httpx.post(url + "/v1/embeddings", json={"input": "x " * 400, "truncate_prompt_tokens": k})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == n, (k, r.text)
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]


def test_score_and_rerank_by_cosine(embed_server):
    import httpx

    url = embed_server.url
    docs = ["Paris is the capital of France.", "Bananas are yellow.", "The Eiffel Tower is in Paris."]
    r = httpx.post(url + "/v1/rerank", json={"query": "What is the capital of France?", "documents": docs,
                                             "top_n": 2}).json()
    assert [x["index"] for x in r["results"]] == [0, 2]
    s = httpx.post(url + "/v1/score", json={"text_1": "What is the capital of France?", "text_2": docs}).json()
    scores = [d["score"] for d in s["data"]]
    assert scores[0] == pytest.approx(r["results"][0]["relevance_score"], abs=1e-6) and scores[1] < scores[0]
    bad = httpx.post(url + "/v1/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
    assert bad.status_code == 400


def test_a_generation_server_refuses_embeddings(smollm2_server):
    import httpx

    r = httpx.post(smollm2_server.url + "/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]


def test_malformed_bodies_get_a_4xx_never_a_5xx(embed_server):
    import httpx

    url = embed_server.url
    cases = [("/v1/embeddings", b) for b in (
        {"input": 5}, {"input": [[]]}, {"input": [["a"]]}, {"input": [1.5]}, {"input": None}, {},
        {"input": "x", "encoding_format": "hex"}, {"input": "x", "dimensions": 0}, {"input": [-1]},
        {"input": [[1, 2], ""]}, {"input": ["ok", "word " * 300]}, {"input": "x", "truncate_prompt_tokens": 0})]
    cases += [("/v1/rerank", {"query": "q", "documents": []}), ("/v1/rerank", {"query": "q", "documents": ["d"],
                                                                              "top_n": 0}),
              ("/v1/rerank", {"query": "", "documents": ["d"]}), ("/v1/score", {"text_1": [], "text_2": "x"}),
              ("/v1/score", {"text_1": "x"}), ("/tokenize", {"prompt": 3})]
    for path, body in cases:
        r = httpx.post(url + path, json=body)
        assert 400 <= r.status_code < 500 and "error" in r.json(), (path, body, r.status_code, r.text[:200])
    r = httpx.post(url + "/v1/embeddings", content=b"not json", headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_one_server_serves_a_generation_and_an_embedding_model(smollm2_path, minilm):
    """``serve --model A --embedding-model B``: one app, both models. Chat answers as the
    generation model alone does, embeddings equal the embedding model's, /v1/models lists both,
    /health watches both, /metrics carries both families; each model's routes refuse the other's name."""
    import httpx

    from nextoken import LLM, SamplingParams
    from tests.helpers.server import LiveServer

    gen = LLM(str(smollm2_path))  # as `serve` runs it (bf16, our kernels)
    srv = LiveServer(gen, "smollm2", embedder=minilm, embedder_name="minilm")
    try:
        client = srv.client()
        chat = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi!"}],
                                              max_tokens=8, temperature=0)
        alone = gen.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=8, temperature=0))
        assert chat.choices[0].message.content == alone[0].outputs[0].text
        r = client.embeddings.create(model="minilm", input=SENTENCES[:2])
        want = [o.outputs.embedding for o in minilm.embed(SENTENCES[:2])]
        assert np.allclose([d.embedding for d in r.data], want, atol=1e-6) and r.model == "minilm"
        assert [m.id for m in client.models.list().data] == ["smollm2", "minilm"]
        assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
        metrics = httpx.get(srv.url + "/metrics").text
        assert "nextoken_embedding_requests_total 1.0" in metrics and "vllm:num_requests_running" in metrics
        tags = httpx.get(srv.url + "/api/tags").json()["models"]  # Ollama's listing names both
        assert [m["name"] for m in tags] == ["smollm2", "minilm"]
        r = httpx.post(srv.url + "/api/embed", json={"model": "minilm", "input": SENTENCES[:2]}).json()
        assert np.allclose(r["embeddings"], want, atol=1e-6)
        wrong = httpx.post(srv.url + "/v1/embeddings", json={"model": "smollm2", "input": "hi"})
        assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model"
        srv.state.embedder.close()  # a model that stops: /health says so
        assert httpx.get(srv.url + "/health").status_code == 503
    finally:
        srv.stop()


@pytest.mark.parametrize("flags", [["--dtype", "float32"], ["--quantization", "q8_0"]])
def test_the_embed_command_takes_the_encoders_options(minilm, capsys, flags):
    """``nextoken embed --json`` prints OpenAI's shape; ``--dtype float32`` gives the float32
    encoder's vectors exactly, ``--quantization q8_0`` (the int8 GEMM) within cosine 0.999."""
    from nextoken.cli import main

    texts = ["a cat sits on the mat", "the stock market fell sharply"]
    assert main(["embed", *texts, "--json", *flags]) == 0
    out = json.loads(capsys.readouterr().out)
    got = torch.tensor([d["embedding"] for d in out["data"]])
    want = torch.tensor([o.outputs.embedding for o in minilm.embed(texts)])
    assert out["object"] == "list" and [d["index"] for d in out["data"]] == [0, 1]
    if flags[0] == "--dtype":
        assert torch.equal(got, want)
    else:
        assert torch.nn.functional.cosine_similarity(got, want).min() >= 0.999 and not torch.equal(got, want)


def test_llm_score_equals_the_score_route(minilm, embed_server):
    """vLLM's `LLM.score`: the same numbers as ``/v1/score`` (one against many, and pair by
    pair), each the cosine of the two texts' `LLM.embed` vectors."""
    import httpx

    query, docs = "Where is the Eiffel Tower?", ["The Eiffel Tower is in Paris.", "Bananas are yellow."]
    got = minilm.score(query, docs)
    served = httpx.post(embed_server.url + "/v1/score", json={"text_1": query, "text_2": docs}).json()["data"]
    assert [o.outputs.score for o in got] == pytest.approx([d["score"] for d in served], abs=1e-6)
    q = np.array(minilm.embed(query)[0].outputs.embedding)
    for o, d in zip(got, docs):
        assert o.outputs.score == pytest.approx(float(q @ np.array(minilm.embed(d)[0].outputs.embedding)), abs=1e-5)
    pairs = minilm.score(docs, docs[::-1])
    assert [o.request_id for o in pairs] == ["0", "1"] and pairs[0].outputs.score == pytest.approx(pairs[1].outputs.score)
    with pytest.raises(InvalidRequest, match="data_1"):
        minilm.score(["a", "b"], ["c", "d", "e"])
