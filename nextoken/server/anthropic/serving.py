"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) as a thin
translation onto the chat path: the same template, engine, sampler, grammar-forced tool calls,
tool-call parser, limits and errors (in Anthropic's shape, `server.app.errors`).

    request (system, messages of text / tool_use / tool_result blocks, tools, tool_choice)
      -> chat messages for the template (`to_chat_messages`) -> ids, SamplingParams
      -> the engine -> content blocks (text, tool_use with the parsed input), stop_reason, usage
         or, streamed, Anthropic's event sequence (message_start, ping, content_block_start /
         _delta / _stop per block, message_delta, message_stop)

The anthropic SDK (2.x) takes no sampling arguments: clients send ``temperature``, ``top_p``,
``top_k`` in the body (``extra_body``); absent, the defaults apply.
"""

from __future__ import annotations


from fastapi import Request

from nextoken import sampling_defaults
from nextoken.errors import InvalidRequest
from nextoken.server.anthropic import mcp as connector
from nextoken.server.anthropic.protocol import CountTokensRequest, Message, MessagesRequest
from nextoken.server.chat.core import ChatSpec, prefilled, prepare, render
from nextoken.server.anthropic.render import MessageRenderer, blocks, event, message, stop_reason
from nextoken.server.chat.events import Failed, Finish
from nextoken.server.chat.run import run
from nextoken.server.api.serving import ApiServing, sse_response


# -- translation --------------------------------------------------------------------------------
def _text(content) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def to_chat_messages(system, messages: list[Message]) -> list[dict]:
    """Anthropic's system and messages as OpenAI chat messages (what the chat templates take):
    text blocks joined, an assistant's ``tool_use`` blocks as ``tool_calls``, a user's
    ``tool_result`` blocks as ``tool`` messages (before the user's own text)."""
    out = [{"role": "system", "content": _text(system)}] if system else []
    for m in messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text = "".join(b.text for b in m.content if b.type == "text")
        if m.role == "assistant":
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                     for b in m.content if b.type == "tool_use"]
            out.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
            continue
        for b in m.content:  # (a user's blocks: text and tool_result, `protocol.UserMessage`)
            if b.type == "tool_result":
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)})
        if text or not any(b.type == "tool_result" for b in m.content):
            out.append({"role": "user", "content": text})
    return out


CHOICES = {"auto": "auto", "none": "none", "any": "required"}  # Anthropic's tool_choice -> the core's


def to_spec(body, conversation: list[dict] | None = None, mcp_tools: list[dict] | None = None,
            first: bool = True) -> ChatSpec:
    """A messages (or count_tokens) request as the chat core's `ChatSpec`; with the MCP
    connector, the conversation so far and its servers' tools (a forcing tool_choice forces the
    first pass only)."""
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                               "parameters": t.input_schema}} for t in body.tools or []]
    tools += mcp_tools or []
    tc = getattr(body, "tool_choice", None)
    choice = None if tc is None else tc.name if tc.type == "tool" else CHOICES[tc.type]
    choice = choice if first or choice in (None, "none") else "auto"
    sampling = {}
    if isinstance(body, MessagesRequest):
        sampling = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
                    "stop": body.stop_sequences}
    messages = conversation if conversation is not None else to_chat_messages(body.system, body.messages)
    messages, prefill = prefilled(messages)  # a final assistant message: the answer continues it
    if prefill and messages[-1]["content"] != messages[-1]["content"].rstrip():
        raise InvalidRequest("final assistant content cannot end with trailing whitespace",
                             f"messages[{len(body.messages) - 1}].content")
    user = body.metadata.user_id if getattr(body, "metadata", None) is not None else None
    return ChatSpec(messages, tools or None, choice,
                    not (tc is not None and tc.disable_parallel_tool_use), None, sampling,
                    getattr(body, "max_tokens", None), priority=getattr(body, "priority", 0),
                    client=f"user:{user}" if user else "", unset=sampling_defaults.unset(body.model_fields_set),
                    continue_final=prefill)


# -- serving ------------------------------------------------------------------------------------
class AnthropicServingMessages(ApiServing):
    """``POST /v1/messages`` and ``/v1/messages/count_tokens`` over the shared engine."""

    async def count_tokens(self, body: CountTokensRequest) -> dict:
        self.check_model(body.model)
        return {"input_tokens": len(render(self.engine.tokenizer, to_spec(body))[0])}

    async def create(self, body: MessagesRequest, request: Request):
        """The message answering `body` (JSON, or Anthropic's event stream with ``stream``)."""
        lora = self.check_model(body.model)
        self.check_queue()
        if body.mcp_servers:
            return await self._connector(body, request, lora)
        p = await prepare(self, to_spec(body))
        res = await run(self, p, request, lora, body.stream, "msg_")
        if body.stream:
            return sse_response(self._stream(res, len(p.ids)))
        return self.message(res)

    async def _connector(self, body, request, lora):
        """A message with the MCP connector (`connector.ConnectorMessage`), streamed or not."""
        answer = await connector.ConnectorMessage(self, body, request, lora, to_spec,
                                                  to_chat_messages(body.system, body.messages)).start()
        if body.stream:
            return sse_response(event(kind, data) async for kind, data in answer.events())
        return await answer.run()

    def message(self, res) -> dict:
        """The message of the core's `ChatResult`: thinking, text, then tool_use blocks."""
        c = res.choices[0]
        return message(res.request_id, self.args.model_name, blocks(c), stop_reason(c),
                       (res.usage.prompt_tokens, res.usage.completion_tokens))

    async def _stream(self, events, num_prompt: int):
        """Anthropic's event sequence for the core's events: content blocks (thinking, text,
        tool_use) opened and closed as the kind changes."""
        yield event("message_start", {"message": message(events.request_id, self.args.model_name, [], (None, None),
                                                         (num_prompt, 0))})
        yield event("ping", {})
        r = MessageRenderer()
        async for ev in events:
            if isinstance(ev, Failed):
                yield event("error", {"error": {"type": "api_error", "message": ev.message}})
                return
            for kind, data in r.core(ev):
                yield event(kind, data)
            if isinstance(ev, Finish):
                stop, seq = stop_reason(ev.choice)
                yield event("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": seq},
                                               "usage": {"output_tokens": ev.usage.completion_tokens}})
                yield event("message_stop", {})
