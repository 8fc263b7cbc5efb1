"""LoRA adapters per request (`nextoken.lora`) against `transformers` + `peft` on the tiny Llama:
float32 logits (unmerged and merged), greedy decoding, mixed batches, the prefix cache's keys,
and adapters that must be refused."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from nextoken import LLM, LoRARequest, SamplingParams
from nextoken.errors import InvalidRequest
from nextoken.request_options import RequestOptions
from tests.helpers.cpu import cpu_has

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 3], [7, 11, 15, 19, 23, 27, 31]]


@pytest.fixture(scope="module")
def adapters(tiny_gguf, tmp_path_factory):
    """Two PEFT adapters with random A and B on the tiny Llama: "a" (rank 4, every target) and
    "b" (rank 8, rsLoRA, q and v only): name -> (LoRARequest, the peft model)."""
    from peft import LoraConfig, get_peft_model

    _, hf = tiny_gguf["llama"]
    out = {}
    specs = (("a", 4, 8, False, ALL), ("b", 8, 4, True, ["q_proj", "v_proj"]))
    for i, (name, r, alpha, rslora, targets) in enumerate(specs):
        torch.manual_seed(10 + i)
        cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False,
                         lora_dropout=0.0)
        model = get_peft_model(copy.deepcopy(hf), cfg).eval()
        d = tmp_path_factory.mktemp(f"lora-{name}")
        model.save_pretrained(d)
        out[name] = (LoRARequest(name, i + 1, str(d)), model)
    return out


@pytest.fixture(scope="module")
def more_adapters(tiny_gguf, tmp_path_factory):
    """Adapters whose ranks are multiples of 16 (the C step's AMX path takes those): "c" (rank 16,
    every target) and "d" (rank 32, q and v only); and "e", of odd rank 5 (every target)."""
    from peft import LoraConfig, get_peft_model

    _, hf = tiny_gguf["llama"]
    out = {}
    for i, (name, r, targets) in enumerate((("c", 16, ALL), ("d", 32, ["q_proj", "v_proj"]), ("e", 5, ALL))):
        torch.manual_seed(20 + i)
        cfg = LoraConfig(r=r, lora_alpha=r, target_modules=targets, init_lora_weights=False, lora_dropout=0.0)
        model = get_peft_model(copy.deepcopy(hf), cfg).eval()
        d = tmp_path_factory.mktemp(f"lora-{name}")
        model.save_pretrained(d)
        out[name] = (LoRARequest(name, 3 + i, str(d)), model)
    return out


@pytest.fixture(scope="module")
def llm(tiny_gguf):
    return LLM(str(tiny_gguf["llama"][0]), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)


def last_logits(llm, ids, lora) -> torch.Tensor:
    rid = llm.engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0),
                                 options=RequestOptions(return_logits=True, lora_request=lora))
    return llm.engine.run_until_finished([rid])[0].logits[0].float()


@pytest.mark.parametrize("name", ["a", "b"])
def test_logits_equal_peft_unmerged_and_merged(llm, adapters, name):
    req, model = adapters[name]
    merged = copy.deepcopy(model).merge_and_unload()
    for ids in PROMPTS:
        ours = last_logits(llm, ids, req)
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0, -1]
            want_merged = merged(torch.tensor([ids])).logits[0, -1]
        assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()
        assert torch.allclose(ours, want_merged, atol=1e-4)
        with torch.no_grad():
            base = model.get_base_model()
            with model.disable_adapter():
                plain = base(torch.tensor([ids])).logits[0, -1]
        assert (ours - plain).abs().max() > 1e-2  # the adapter changes the answer


def test_an_odd_rank_equals_peft_and_leaves_the_stacks_even(tiny_gguf, more_adapters):
    """Rank 5 ("e") is held padded with a zero rank: its logits still equal peft's, and beside a
    rank-16 adapter every row's columns start at an even column of stacks of even width (the C
    step's pair-interleaved copies exist and take every row, whatever shares its batch)."""
    (e, model), (c, _) = more_adapters["e"], more_adapters["c"]
    llm = LLM(str(tiny_gguf["llama"][0]), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16)
    for ids in PROMPTS:
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0, -1]
        assert torch.allclose(last_logits(llm, ids, e), want, atol=1e-4)
    loras = llm.engine.runner.loras
    loras.add(c)
    for rows in ([e.lora_int_id, 0, c.lora_int_id], [c.lora_int_id, e.lora_int_id]):
        loras.set_batch(rows)
        assert all(int(s) % 2 == 0 for s in loras.batch.row_start)
        assert all(lin.lora.stacks(torch.float32)[0].shape[0] % 2 == 0 for lin in loras.linears.values())


def test_a_llama_cpp_gguf_adapter_equals_its_peft_folder(tiny_gguf, adapters):
    """tests/data/lora-tiny-llama.gguf is adapter "a" (the same seeds) converted by llama.cpp's own
    converter (``convert_lora_to_gguf.py lora --base base --outtype f32``, llama-cpp-python
    0.3.36's vendored tree): read back, with its Q and K un-permuted, it gives peft's logits."""
    from pathlib import Path

    req, model = adapters["a"]
    gguf_req = LoRARequest("a-gguf", 1, str(Path(__file__).parents[1] / "data" / "lora-tiny-llama.gguf"))
    fresh = LLM(str(tiny_gguf["llama"][0]), dtype="float32", enable_lora=True, max_lora_rank=8)
    for ids in PROMPTS:
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0, -1]
        got = last_logits(fresh, ids, gguf_req)
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    qwen = LLM(str(tiny_gguf["qwen2"][0]), dtype="float32", enable_lora=True, max_lora_rank=8)
    with pytest.raises(InvalidRequest, match="a llama adapter on a qwen2 model"):
        qwen.generate([PROMPTS[1]], SamplingParams(max_tokens=2), lora_request=gguf_req)


def test_greedy_decoding_equals_peft_generate(llm, adapters):
    req, model = adapters["a"]
    ids = PROMPTS[0]
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), lora_request=req)[0]
    with torch.no_grad():
        want = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, len(ids):].tolist()
    assert out.outputs[0].token_ids == want


def test_a_mixed_batch_equals_each_request_alone(llm, adapters):
    """Requests for "a", the base model and "b" in one batch (and the same prompt, so that the
    prefix cache would share their blocks if its keys ignored the adapter)."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[0], PROMPTS[1]]
    loras = [adapters["a"][0], None, adapters["b"][0], adapters["a"][0]]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]
    alone = [llm.generate([p], params, lora_request=lo)[0].outputs[0].token_ids for p, lo in zip(prompts, loras)]
    assert together == alone
    assert len({tuple(t) for t in together[:3]}) == 3  # three models, three answers


def write_adapter(d, cfg: dict, tensors: dict) -> LoRARequest:
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(d / "adapter_model.safetensors"))
    return LoRARequest(d.name, 9, str(d))


def test_bad_adapters_are_refused_by_name(llm, tmp_path):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    ok = {key.format("A"): torch.zeros(4, 64), key.format("B"): torch.zeros(64, 4)}
    cases = {
        "rank 32, above max_lora_rank 8": write_adapter(tmp_path / "big", {"r": 32, "target_modules": ["q_proj"]},
                                                        {key.format("A"): torch.zeros(32, 64),
                                                         key.format("B"): torch.zeros(64, 32)}),
        "is missing": LoRARequest("gone", 9, str(tmp_path / "nowhere")),
        "are not supported": write_adapter(tmp_path / "head", {"r": 4, "target_modules": ["lm_head"]}, ok),
        "another base model": write_adapter(tmp_path / "other", {"r": 4, "target_modules": ["q_proj"]},
                                            {key.format("A"): torch.zeros(4, 96), key.format("B"): torch.zeros(64, 4)}),
    }
    for message, req in cases.items():
        with pytest.raises(InvalidRequest, match=message) as e:
            llm.generate([PROMPTS[1]], SamplingParams(max_tokens=2), lora_request=req)
        assert e.value.field == "lora"
    assert not llm.engine.has_unfinished_requests() and len(llm.runner.loras.loaded) <= 2
    good = write_adapter(tmp_path / "good", {"r": 4, "target_modules": ["q_proj"]}, ok)
    with pytest.raises(InvalidRequest, match="max_loras"):  # "a" and "b" are loaded: the limit
        llm.generate([PROMPTS[1]], SamplingParams(max_tokens=2), lora_request=good)
    assert llm.runner.loras.remove(1) and llm.generate([PROMPTS[1]], SamplingParams(max_tokens=2),
                                                         lora_request=good)[0].outputs[0].token_ids


def test_lora_needs_enable_lora(tiny_gguf, adapters):
    plain = LLM(str(tiny_gguf["llama"][0]), dtype="float32")
    with pytest.raises(InvalidRequest, match="enable_lora"):
        plain.generate([PROMPTS[1]], SamplingParams(max_tokens=2), lora_request=adapters["a"][0])


@pytest.fixture(scope="module")
def lora_server(tiny_gguf):
    from tests.helpers.server import LiveServer

    srv = LiveServer(LLM(str(tiny_gguf["llama"][0]), dtype="float32", enable_lora=True, max_loras=2,
                         max_lora_rank=8), "tiny")
    yield srv
    srv.stop()


def test_adapters_load_serve_and_unload_at_runtime(lora_server, adapters):
    """vLLM's surface: load an adapter, list it, send requests to it by model name (equal to
    `peft`'s greedy answer), load a second while a request on the first still runs,
    refuse to unload one in use, unload it after."""
    import threading

    import httpx

    url, (a, peft_a), (b, _) = lora_server.url, adapters["a"], adapters["b"]
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "ad-a", "lora_path": a.lora_path})
    assert r.status_code == 200, r.text
    models = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
    assert models["ad-a"]["parent"] == "tiny" and models["ad-a"]["root"] == a.lora_path
    with torch.no_grad():
        want = peft_a.generate(input_ids=torch.tensor([PROMPTS[0]]), attention_mask=torch.ones(1, len(PROMPTS[0]),
                               dtype=torch.long), max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, 20:].tolist()
    body = {"model": "ad-a", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    got = httpx.post(url + "/v1/completions", json=body).json()
    assert got["choices"][0]["text"] == lora_server.llm.tokenizer.decode(want)
    long = {"model": "ad-a", "prompt": PROMPTS[1], "max_tokens": 240, "temperature": 0, "ignore_eos": True}
    result = {}
    t = threading.Thread(target=lambda: result.update(r=httpx.post(url + "/v1/completions", json=long, timeout=60)))
    t.start()
    while not lora_server.llm.engine.has_unfinished_requests():
        assert t.is_alive(), "the long request ended before the test could load an adapter beside it"
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "ad-b", "lora_path": b.lora_path})
    assert r.status_code == 200
    assert httpx.post(url + "/v1/completions", json={**body, "model": "ad-b"}).status_code == 200
    busy = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "ad-a"})
    t.join()
    assert result["r"].status_code == 200 and result["r"].json()["usage"]["completion_tokens"] == 240
    assert busy.status_code == 400 and "still use" in busy.json()["error"]["message"]
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "ad-a"}).status_code == 200
    r = httpx.post(url + "/v1/completions", json=body)
    assert r.status_code == 404 and "'ad-a' not found" in r.json()["error"]["message"]


def test_bad_adapters_over_http_are_4xx(lora_server, tmp_path):
    import httpx

    url = lora_server.url
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "none")})
    assert r.status_code == 400 and "is missing" in r.json()["error"]["message"]
    assert httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "tiny", "lora_path": "p"}).status_code == 400
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "nope"}).status_code == 404
    r = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404


def test_lora_modules_are_parsed_by_name():
    from nextoken.lora import parse_lora_modules

    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in parse_lora_modules(["a=/x", "b=/y=z"])] == \
        [("a", 1, "/x"), ("b", 2, "/y=z")]
    for bad in (["a"], ["=x"], ["a=/x", "a=/y"]):
        with pytest.raises(InvalidRequest):
            parse_lora_modules(bad)


def test_an_adapter_trained_on_smollm2_changes_its_answer(smollm2_path, smollm2_hf, tmp_path):
    """Real behaviour: a rank-8 adapter trained 12 steps (peft, on `transformers`' float32 load of
    the same GGUF) to continue "The capital of France is" with " Atlantis, the lost city". Our
    float32 logits equal peft's; and on the default path (bf16, our quantized kernels) the
    adapter's request says Atlantis while a base request in the same batch still says Paris."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(copy.deepcopy(smollm2_hf), LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
    f32 = LLM(str(smollm2_path), dtype="float32", enable_lora=True, max_lora_rank=8)
    prompt = f32.tokenizer.encode("The capital of France is")
    target = f32.tokenizer.encode(" Atlantis, the lost city", add_bos=False)
    x = torch.tensor([prompt + target])
    labels = x.clone()
    labels[0, : len(prompt)] = -100
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(12):
        model(input_ids=x, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    model.save_pretrained(tmp_path / "atlantis")
    req = LoRARequest("atlantis", 1, str(tmp_path / "atlantis"))
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0, -1]
    assert torch.allclose(last_logits(f32, prompt, req), want, atol=1e-4)
    fast = LLM(str(smollm2_path), enable_lora=True, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=4)
    outs = fast.generate([prompt, prompt], params, lora_request=[req, None])
    assert outs[0].outputs[0].text.startswith(" Atlantis") and outs[1].outputs[0].text.startswith(" Paris")


@pytest.mark.usefixtures("two_threads")  # lora_add_n splits rows and ranks over the threads
@pytest.mark.parametrize("isa, names", [(None, "ab"), ("avx2", "ab"), ("portable", "ab"), (None, "ca"),
                                         (None, "cd"), ("avx2", "cd"), (None, "ce")])
def test_the_c_decode_step_adds_each_rows_adapter(tiny_gguf, adapters, more_adapters, isa, names):
    """bf16 on our kernels, the one-call C step adds each row's adapter (`layers.native_decode`):
    decode steps mixing the first adapter, the base model and the second over the same cache equal
    the PyTorch layers' LoRA (the same stacks) to bf16 rounding, for every row; prompts of each kind
    run there too, and each sequence's rows are bit for bit those it gets alone. With the kernels
    built for this CPU, for AVX2 (no vdpbf16ps) and portable (plain C loops); ranks 4 and 8 ("a",
    "b"), 16 and 32 ("c", "d": on AMX tiles where the CPU has them), 16 beside 4 and beside the
    odd rank 5 in one step."""
    from nextoken.kernels import load
    from nextoken.loader.gguf import GGUFFile
    from nextoken.runner.model_runner import ModelRunner, SequenceInput

    path = tiny_gguf["llama"][0]
    native, plain = (ModelRunner(GGUFFile(path), torch.bfloat16) for _ in range(2))
    assert native.native_decoder is not None, native.plan.describe(native.model)
    if isa is not None:
        native.native_decoder.lib = load("decode", portable=True) if isa == "portable" else load("decode", isa=isa)
        assert native.native_decoder.lib is not None
        assert native.native_decoder.lib.decode_lora_amx() == 0
    elif "c" in names and cpu_has("amx_bf16") and cpu_has("avx512_bf16"):
        assert native.native_decoder.lib.decode_lora_amx() == 1  # the AMX path is the one measured here
    plain.native_decoder = None
    every = {**adapters, **more_adapters}
    for r in (native, plain):
        r.enable_lora(2, 32)
        for name in names:
            r.loras.add(every[name][0])
    ids = [every[name][0].lora_int_id for name in names]
    loras, tables = [ids[0], 0, ids[1], ids[0]], [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    prompts = [PROMPTS[0][:n] for n in (20, 20, 20)] + [PROMPTS[1]]

    def run(r, which, cached: bool):
        r.init_kv_cache(16, 16)
        prefill = [SequenceInput(prompts[i], 0, tables[i], lora_id=loras[i]) for i in which]
        if cached:  # the prompts on the PyTorch layers: both runners then hold the same keys and values
            decoder, r.native_decoder = r.native_decoder, None
            r.execute(prefill)
            r.native_decoder = decoder
            first = None
        else:
            first = r.execute(prefill)
        steps = [r.execute([SequenceInput([40 + step + i], len(prompts[i]) + step, tables[i], lora_id=loras[i])
                            for i in which]) for step in range(3)]
        return first, torch.stack(steps)

    from nextoken.kernels import fallbacks

    before = fallbacks["native decode step"]
    _, fast = run(native, range(4), cached=True)
    _, slow = run(plain, range(4), cached=True)
    assert fallbacks["native decode step"] == before  # the C step took every step
    spread = float(slow.std())
    assert float((fast - slow).abs().max()) <= 0.02 * spread
    assert float((slow[:, 0] - slow[:, 1]).abs().max()) > 0.1 * spread  # the adapter changes the answer
    together = run(native, range(4), cached=False)
    for i in range(4):
        first, steps = run(native, [i], cached=False)
        assert torch.equal(together[0][i], first[0]) and torch.equal(together[1][:, i], steps[:, 0])
