"""The server's routes that belong to no one API: `info` (health, models, metrics, load,
version, tokenizer, LoRA adapters) and `tokens` (tokenize, detokenize, watermark detection).
Each API's own routes are its package's router (`server.openai.router`, `server.anthropic.router`,
`server.ollama.router`). Each route reads what it needs from ``request.app.state``
(`server.app.build_app` puts the server's state, args, metrics and serving objects there)."""

from __future__ import annotations

import asyncio
import dataclasses

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response

from nextoken.server.chat import prompts
from nextoken.server.chat import tools as tools_mod
from nextoken.server.app.errors import error_response
from nextoken.errors import InvalidRequest, NotFound
from nextoken.server.api.routing import OPENAI, ApiRouter
from nextoken.server.openai.protocol import (DetokenizeAnswer, DetokenizeRequest, HealthAnswer, LoadLoRARequest,
                                             LoadReport, ModelCard, ModelCardList, ServerVersion, TokenizeAnswer,
                                             TokenizeChatRequest, TokenizeRequest, TokenizerInfo, UnloadLoRARequest,
                                             WatermarkDetectRequest, WatermarkDetection, WatermarkText)
from nextoken.server.api.serving import check_token_ids

info = ApiRouter(OPENAI)
tokens = ApiRouter(OPENAI)

def _engine(request: Request):
    """The `EngineClient` behind the server (the Gate answers 503 before this while loading).
    Raises `InvalidRequest` on a server without a generation model."""
    state = request.app.state.server
    if state.engine is None:
        raise InvalidRequest(f"model {request.app.state.args.model_name!r} is an embedding model: this route needs "
                             "a generation model", "model")
    return state.engine


def _check_model(request: Request, name: str | None) -> None:
    request.app.state.serving_completion.check_model(name)


# -- info -------------------------------------------------------------------------------------
@info.get("/health", response_model=HealthAnswer)
async def health(request: Request):
    state = request.app.state.server
    if state.draining:
        return error_response(503, "the server is shutting down")
    if not state.ready or not state.clients():
        return error_response(503, "the model is still loading")
    for client in state.clients():  # the generation engine and the embedding service alike
        if not client.is_running:
            why = repr(client.dead) if client.dead is not None else "its process exited"
            return error_response(503, f"the engine loop has stopped: {why}")
    return {"status": "ok"}


@info.get("/version", response_model=ServerVersion)
async def version():
    from nextoken import __version__

    return {"version": __version__}


@info.get("/v1/models", response_model=ModelCardList)
async def models(request: Request):
    state, args = request.app.state.server, request.app.state.args
    base = {"object": "model", "created": int(state.started), "owned_by": "nextoken"}
    data = []
    if state.engine is not None:
        gen = {**base, "max_model_len": state.engine.max_model_len}
        data += [{"id": name, **gen, "root": args.model_name, "parent": None}  # (vLLM lists each served name)
                 for name in (args.model_name, *args.model_aliases)]
        data += [{"id": name, **gen, "root": lora.lora_path, "parent": args.model_name}  # vLLM's shape
                 for name, lora in state.loras.items()]
    if state.embedder is not None:
        name = state.embedding_model_name or args.model_name
        data.append({"id": name, **base, "max_model_len": state.embedder.model.max_seq_length, "root": name,
                     "parent": None})
    return {"object": "list", "data": data}


@info.get("/v1/models/{model:path}", response_model=ModelCard)
async def model_card(model: str, request: Request):
    """OpenAI's retrieve-model route (``client.models.retrieve(name)``): that model's card of
    ``/v1/models``. Raises `NotFound` naming the served models for another name."""
    cards = (await models(request))["data"]
    for card in cards:
        if card["id"] == model:
            return card
    raise NotFound(f"model {model!r} not found; this server serves {', '.join(repr(c['id']) for c in cards)}",
                   "model")


def _one_front_end(request: Request) -> None:
    """Adapters loaded at runtime are served only by one HTTP server process: refused with
    ``--api-server-count`` above 1 (each process keeps its own list of served models)."""
    if request.app.state.args.api_server_count > 1:
        raise InvalidRequest("loading or unloading a LoRA adapter at runtime needs --api-server-count 1 (each HTTP "
                             "server process keeps its own list of models); serve adapters with --lora-modules",
                             "lora_name")


@info.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRARequest, request: Request):
    """vLLM's: load a PEFT adapter at runtime and serve it as model ``lora_name``."""
    from nextoken.lora import LoRARequest

    state = request.app.state.server
    _one_front_end(request)
    loras = state.__dict__.setdefault("loras", {})
    if body.lora_name in loras or body.lora_name == request.app.state.args.model_name:
        raise InvalidRequest(f"a model named {body.lora_name!r} is served already", "lora_name")
    lora = LoRARequest(body.lora_name, max((x.lora_int_id for x in loras.values()), default=0) + 1, body.lora_path)
    await state.engine.load_lora(lora)
    loras[body.lora_name] = lora
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@info.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoRARequest, request: Request):
    """vLLM's: stop serving adapter ``lora_name`` (refused while a request still uses it)."""
    _one_front_end(request)
    loras = getattr(request.app.state.server, "loras", {})
    lora = loras.get(body.lora_name)
    if lora is None:
        raise NotFound(f"no LoRA adapter named {body.lora_name!r} is loaded", "lora_name")
    await request.app.state.server.engine.unload_lora(lora.lora_int_id)
    del loras[body.lora_name]
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


@info.get("/metrics")
async def prom(request: Request):
    return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4")


@info.get("/get_load", response_model=LoadReport)
async def get_load(request: Request):
    """SGLang's load report, read by the routers derived from SGLang's (vllm-router's
    ``/get_loads``, its ``power_of_two`` policy): the requests running plus waiting."""
    stats = _engine(request).scheduler_stats()
    return {"load": stats.running + stats.waiting, "num_reqs": stats.running, "num_waiting_reqs": stats.waiting}


@info.get("/tokenizer_info", response_model=TokenizerInfo)
async def tokenizer_info(request: Request):
    """vLLM's tokenizer description (lm-evaluation-harness's ``tokenizer_backend=remote`` reads
    it, then tokenizes through /tokenize)."""
    eng = _engine(request)
    tok = eng.tokenizer

    def text(i):
        return tok.tokens[i] if i is not None else None

    return {"tokenizer_class": "nextoken", "eos_token": text(tok.eos_token_id), "bos_token": text(tok.bos_token_id),
            "pad_token": None, "add_bos_token": tok.add_bos, "chat_template": tok.chat_template,
            "model_max_length": eng.max_model_len, "vocab_size": eng.config.vocab_size}


# -- tokens -----------------------------------------------------------------------------------
@tokens.post("/tokenize", response_model=TokenizeAnswer)
async def tokenize(body: TokenizeRequest, request: Request):
    _check_model(request, body.model)
    eng = _engine(request)
    if isinstance(body, TokenizeChatRequest):
        ids = prompts.encode_chat(eng.tokenizer, tools_mod.messages_for_template(
            [m.template_dict() for m in body.messages]))
    else:
        ids = eng.tokenizer.encode(body.prompt, add_bos=None if body.add_special_tokens else False, parse_special=False)
    return {"tokens": ids, "count": len(ids), "max_model_len": eng.max_model_len}


@tokens.post("/detokenize", response_model=DetokenizeAnswer)
async def detokenize(body: DetokenizeRequest, request: Request):
    _check_model(request, body.model)
    eng = _engine(request)
    check_token_ids(eng, body.tokens)
    return {"prompt": eng.tokenizer.decode(body.tokens)}


@tokens.post("/v1/watermark/detect", response_model=WatermarkDetection)
async def watermark_detect(body: WatermarkDetectRequest, request: Request):
    _check_model(request, body.model)
    eng = _engine(request)
    if isinstance(body, WatermarkText):
        ids = eng.tokenizer.encode(body.text, add_bos=False, parse_special=False)
    else:
        ids = check_token_ids(eng, body.tokens)
    from nextoken.sample.watermark import detect  # (imports PyTorch: a server process over an engine process need not)

    res = await asyncio.to_thread(detect, ids, eng.config.vocab_size, eng.watermark.gamma, body.z_threshold)
    return {**dataclasses.asdict(res), "gamma": eng.watermark.gamma}
