"""``POST /v1/chat/completions`` (as vLLM's ``OpenAIServingChat``): messages rendered by the
chat template (with tools when given), one request into the engine, the message back as JSON or
as server-sent events; forced tool calls by a grammar, free ones parsed from the text."""

from __future__ import annotations

import time
import uuid

from fastapi import Request

from nextoken.errors import InvalidRequest
from nextoken.server import responses as R
from nextoken.server import tools as tools_mod
from nextoken.server.protocol import ChatCompletionRequest
from nextoken.server.serving import OpenAIServing, no_lora_beams, sse_response


class OpenAIServingChat(OpenAIServing):
    async def create(self, body: ChatCompletionRequest, request: Request):
        """The response to `body`. Raises `InvalidRequest` for a bad request (naming the field),
        `NotFound` for another model, `QueueFull` when too many wait."""
        lora = self.check_model(body.model)
        body.check_rules()
        self.check_queue()
        eng = self.engine
        for name in ("max_tokens", "max_completion_tokens"):
            limit = getattr(body, name)
            if limit is not None and limit >= eng.engine.max_model_len:
                raise InvalidRequest(f"{name} is {limit}: no room for the prompt in the context length "
                                     f"{eng.engine.max_model_len} (max_model_len)", name)
        tok = eng.engine.tokenizer
        messages = tools_mod.messages_for_template([m.model_dump(exclude_none=True) for m in body.messages])
        tools, forced = _tool_setup(body, tok)
        ids = R.encode_chat(tok, messages, tools, body.chat_template_kwargs)
        max_tokens = body.max_completion_tokens or body.max_tokens or \
            R.default_max_tokens(eng.engine, len(ids), self.args.max_tokens_default)
        if body.use_beam_search:
            no_lora_beams(lora)
            out = (await self.beam(body, [ids], max_tokens))[0]
            return R.chat_response(eng.engine, body, out, int(time.time()), self.args.model_name)
        structured = forced or body.structured()
        await self.compile(structured)
        params = body.sampling_params(max_tokens, (body.top_logprobs or 0) if body.logprobs else None, structured)
        rid = await eng.add_request(ids, params, f"chatcmpl-{uuid.uuid4().hex}", lora_request=lora)
        created = int(time.time())
        names = frozenset(t["function"]["name"] for t in tools) if tools else None
        if body.stream:
            return sse_response(R.stream_chat(eng, body, rid, created, self.args.model_name, self.metrics, names,
                                              self.args.reasoning_parser))
        out = (await self.collect([rid], request))[0]
        self.record([out])
        return R.chat_response(eng.engine, body, out, created, self.args.model_name, names, self.args.reasoning_parser)


def _tool_setup(body: ChatCompletionRequest, tok):
    """``(tools for the template or None, the grammar forcing calls or None)`` of a chat request
    (the rules table refuses a tool_choice without tools). Raises `InvalidRequest` for a model
    whose chat template cannot render tools."""
    choice = body.tool_choice
    if not body.tools or choice == "none":
        return None, None
    tools_mod.require_tool_template(tok.chat_template)
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    if choice is None or choice == "auto":
        return tools, None
    name = None if choice == "required" else choice.function.name
    return tools, tools_mod.forced_grammar(tok, tools, name, body.parallel_tool_calls)
