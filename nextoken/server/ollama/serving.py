"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``, ``/api/ps``,
``/api/version``) as a translation onto the engine: chat through the chat template and the
tool-call parser, generate as a plain completion; streamed as newline-delimited JSON, as Ollama
does; ``options`` mapped onto `SamplingParams`; ``format`` (``"json"`` or a JSON schema) through
structured output; errors in Ollama's shape (``{"error": message}``, `server.app.errors`).

The final object of every answer carries Ollama's counts and durations, in nanoseconds:
``total_duration`` (arrival to the last token), ``load_duration`` (0: the model is loaded),
``prompt_eval_count`` / ``prompt_eval_duration`` (the prompt and the time to the first token),
``eval_count`` / ``eval_duration`` (the generated tokens and the time after the first).
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timezone
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from nextoken import sampling_defaults
from nextoken.errors import InvalidRequest
from nextoken.server.chat import tools as tools_mod
from nextoken.server.chat.core import ChatSpec, Prepared, prefilled, prepare
from nextoken.server.chat.events import Failed, Finish, Text, Thought
from nextoken.server.chat.run import run
from nextoken.server.ollama.protocol import ChatRequest, GenerateRequest, Message, ShowRequest
from nextoken.server.api.serving import ApiServing
from nextoken.structured.params import StructuredOutputsParams
from nextoken.server.api.stream_json import stream_json

# options -> SamplingParams fields (Ollama's other options, runner settings, are accepted and unused)
OPTIONS = {"num_predict": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
           "min_p": "min_p", "repeat_penalty": "repetition_penalty", "seed": "seed", "stop": "stop",
           "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}


def sampling_fields(options: dict | None) -> tuple[dict, int | None]:
    """(`SamplingParams` fields, max_tokens or None) from Ollama's `options` (num_predict -1 or
    absent: None, the server's bound); the runner options (num_ctx, num_thread, ...) change
    nothing here."""
    values: dict[str, Any] = {}
    max_tokens = None
    for key, value in (options or {}).items():
        if key == "num_predict":
            max_tokens = None if isinstance(value, int) and value < 0 else value
        elif key in OPTIONS:
            values[OPTIONS[key]] = [value] if key == "stop" and isinstance(value, str) else value
    return values, max_tokens


def constraint(fmt) -> StructuredOutputsParams | None:
    """Ollama's `format` ("json" or a JSON schema) as an output constraint."""
    if fmt is None:
        return None
    return StructuredOutputsParams(json_object=True) if fmt == "json" else StructuredOutputsParams(json=fmt)


def to_spec(body, messages: list[dict] | None = None) -> ChatSpec:
    """A chat request (or, with its `messages`, a generate request) as the chat core's
    `ChatSpec` (Ollama has no tool_choice: auto)."""
    sampling, max_tokens = sampling_fields(body.options)
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise InvalidRequest(f"options.num_predict must be a positive integer or -1 (got {max_tokens!r})",
                             "options.num_predict")
    tools = getattr(body, "tools", None)
    messages, prefill = prefilled([_chat_message(m) for m in body.messages] if messages is None else messages)
    return ChatSpec(messages,
                    [t.model_dump(exclude_none=True) for t in tools] if tools else None,
                    None, True, constraint(body.format), sampling, max_tokens,
                    fields={"max_tokens": "options.num_predict", "constraint": "format", "sampling": "options",
                            "priority": "options.priority"},
                    priority=(body.options or {}).get("priority", 0), unset=sampling_defaults.unset(sampling),
                    continue_final=prefill)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _stats(out) -> dict:
    """Ollama's final counts and durations (nanoseconds) of a finished `RequestOutput`."""
    m, c = out.metrics, out.outputs[0]
    end = m.finished_time or time.perf_counter()
    first = m.first_token_time or end
    ns = lambda s: int(s * 1e9)  # noqa: E731
    return {"done_reason": "length" if c.finish_reason == "length" else "stop",
            "total_duration": ns(end - m.arrival_time), "load_duration": 0,
            "prompt_eval_count": len(out.prompt_token_ids), "prompt_eval_duration": ns(first - m.arrival_time),
            "eval_count": len(c.token_ids), "eval_duration": ns(end - first)}


def _line(obj: dict) -> str:
    return stream_json(obj) + "\n"


class OllamaServing(ApiServing):
    """Ollama's routes over the shared engine."""

    def check_model(self, name: str | None):
        """Ollama's clients name models with a tag (``smollm2:latest``): the served name, with or
        without ``:latest``."""
        return super().check_model(name.removesuffix(":latest") if name else name)

    async def chat(self, body: ChatRequest, request: Request):
        self.check_model(body.model)
        self.check_queue()
        if not body.messages:  # Ollama's way to load a model: an empty answer, done
            return {"model": body.model, "created_at": _now(), "message": {"role": "assistant", "content": ""},
                    "done_reason": "load", "done": True}
        return await self._answer(body, await prepare(self, to_spec(body)), request, chat=True)

    async def generate(self, body: GenerateRequest, request: Request):
        self.check_model(body.model)
        self.check_queue()
        tok = self.engine.tokenizer
        if not body.prompt and not body.system:  # Ollama's way to load a model: an empty prompt
            return {"model": body.model, "created_at": _now(), "response": "", "done": True, "done_reason": "load"}
        if body.raw or not tok.chat_template:
            ids = tok.encode(body.prompt)
            spec = to_spec(body, [])
            spec.prompt_ids = ids
        else:
            spec = to_spec(body, ([{"role": "system", "content": body.system}] if body.system else [])
                           + [{"role": "user", "content": body.prompt}])
        return await self._answer(body, await prepare(self, spec), request, chat=False)

    async def _answer(self, body, p: Prepared, request: Request, chat: bool):
        res = await run(self, p, request, self.check_model(body.model), body.stream, "ollama-")
        if body.stream:
            return StreamingResponse(self._stream(body.model, res, chat, bool(p.names)),
                                     media_type="application/x-ndjson")
        return self._final(body.model, res.choices[0], res.output, chat)

    def _final(self, model: str, c, out, chat: bool, sent: tuple[bool, bool] = (False, False)) -> dict:
        """The last object for the core's `Choice` `c` (and the engine's output, for the counts);
        `sent`: whether its thought, and its text, went out in the stream already."""
        head = {"model": model, "created_at": _now()}
        thought, text = "" if sent[0] else c.thought, "" if sent[1] else c.text
        extra = {"thinking": thought} if thought else {}
        if not chat:
            return {**head, "response": text, **extra, "done": True, **_stats(out)}
        message = {"role": "assistant", "content": text, **extra}
        if c.calls:
            message["tool_calls"] = [{"function": {"name": call.name, "arguments": tools_mod.arguments_object(call.arguments)}}
                                     for call in c.calls]
        return {**head, "message": message, "done": True, **_stats(out)}

    async def _stream(self, model: str, events, chat: bool, tools: bool):
        """One JSON object per line as text arrives, then a last one with the counts. With
        `tools` the answer's text is held (a call is only known whole): the last object carries
        it and the calls."""
        async for ev in events:
            if isinstance(ev, Failed):
                yield _line({"error": ev.message})
                return
            if isinstance(ev, Finish):
                yield _line(self._final(model, ev.choice, ev.output, chat, sent=(True, not tools)))
            elif isinstance(ev, Thought) or (isinstance(ev, Text) and not tools):
                field = "thinking" if isinstance(ev, Thought) else "content" if chat else "response"
                body = {"message": {"role": "assistant", "content": "", field: ev.text}} if chat else {field: ev.text}
                yield _line({"model": model, "created_at": _now(), **body, "done": False})

    def tags(self) -> dict:
        """The served model, and the embedding model beside it (``--embedding-model``)."""
        models = [self._model_entry()]
        name = self.state.embedding_model_name
        if self.state.embedder is not None and name and name != self.args.model_name:
            models.append({"name": name, "model": name, "modified_at": _now(), "size": 0, "digest": "",
                           "details": {"family": "bert"}})
        return {"models": models}

    def ps(self) -> dict:
        entry = self._model_entry()
        return {"models": [{**entry, "expires_at": "0001-01-01T00:00:00Z", "size_vram": 0}]}

    def show(self, body: ShowRequest) -> dict:
        self.check_model(body.model)
        eng = self.engine
        cfg = eng.config
        return {"modelfile": f"FROM {eng.model_path}\n", "parameters": "",
                "template": eng.tokenizer.chat_template or "",
                "details": self._details(), "capabilities": ["completion"] + (
                    ["tools"] if tools_mod.supports_tools(eng.tokenizer.chat_template) else []),
                "model_info": {"general.architecture": cfg.architecture, "general.name": cfg.name,
                               f"{cfg.architecture}.context_length": eng.max_model_len,
                               f"{cfg.architecture}.embedding_length": cfg.hidden_size,
                               f"{cfg.architecture}.block_count": cfg.num_layers,
                               f"{cfg.architecture}.attention.head_count": cfg.num_heads,
                               f"{cfg.architecture}.attention.head_count_kv": cfg.num_kv_heads}}

    def _details(self) -> dict:
        eng = self.engine
        path = str(eng.model_path)
        return {"parent_model": "", "format": "gguf" if path.endswith(".gguf") else "safetensors",
                "family": eng.config.architecture, "families": [eng.config.architecture],
                "parameter_size": "", "quantization_level": ""}

    def _model_entry(self) -> dict:
        import os

        eng = self.engine
        path = str(eng.model_path) if eng is not None else ""
        size = os.path.getsize(path) if path and os.path.isfile(path) else 0
        return {"name": self.args.model_name, "model": self.args.model_name, "modified_at": _now(), "size": size,
                "digest": "", "details": self._details() if eng is not None else {}}


def _chat_message(m: Message) -> dict:
    """An Ollama chat message as an OpenAI chat message (tool calls with ids for the template)."""
    out: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id or f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for c in m.tool_calls]
    return out
