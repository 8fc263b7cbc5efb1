"""``POST /v1/chat/completions`` (as vLLM's ``OpenAIServingChat``): messages rendered by the
chat template (with tools when given), one request into the engine, the message back as JSON or
as server-sent events; forced tool calls by a grammar, free ones parsed from the text."""

from __future__ import annotations

import time

from fastapi import Request

from nextoken import sampling_defaults
from nextoken.engine.validation import kept_prompt
from nextoken.errors import InvalidRequest
from nextoken.server.openai import render as R
from nextoken.server.chat.core import ChatSpec, prepare
from nextoken.server.chat.run import result, run
from nextoken.server.openai.protocol import ChatCompletionRequest, NamedToolChoice
from nextoken.server.api.serving import ApiServing, no_lora_beams, sse_response


class OpenAIServingChat(ApiServing):
    async def create(self, body: ChatCompletionRequest, request: Request):
        """The response to `body`. Raises `InvalidRequest` for a bad request (naming the field),
        `NotFound` for another model, `QueueFull` when too many wait."""
        lora = self.check_model(body.model)
        body.check_rules()
        if body.chat_template is not None and not self.args.trust_request_chat_template:
            raise InvalidRequest("a request's chat_template is taken only from a server started with "
                                 "--trust-request-chat-template", "chat_template")
        self.check_queue()
        if body.return_tokens_as_token_ids is None:
            body.return_tokens_as_token_ids = self.args.return_tokens_as_token_ids
        p = await prepare(self, to_spec(body))
        created, tok, model = int(time.time()), self.engine.tokenizer, self.args.model_name
        if body.use_beam_search:
            no_lora_beams(lora)
            out = (await self.beam(body, [p.ids], p.params.max_tokens, request))[0]
            return R.chat_response(tok, body, result(out, None, None), created, model)
        res = await run(self, p, request, lora, body.stream, "chatcmpl-")
        if body.stream:
            return sse_response(R.stream_chat(tok, body, res, res.request_id, created, model,
                                              bool(p.names),
                                              kept_prompt(p.ids, p.params.truncate_prompt_tokens,
                                                          self.engine.max_model_len)))
        return R.chat_response(tok, body, res, created, model, bool(self.args.reasoning_parser))


def to_spec(body: ChatCompletionRequest) -> ChatSpec:
    """The request as the chat core's `ChatSpec` (the rules table has checked its cross-field rules)."""
    choice = body.tool_choice
    used = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    if body.continue_final_message and body.add_generation_prompt:
        raise InvalidRequest("continue_final_message continues the last message: it needs add_generation_prompt "
                             "false", "continue_final_message")
    return ChatSpec([m.template_dict() for m in body.messages],
                    [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
                    choice.function.name if isinstance(choice, NamedToolChoice) else choice,
                    body.parallel_tool_calls, body.structured(),
                    {**body.sampling_fields((body.top_logprobs or 0) if body.logprobs else None),
                     "prompt_logprobs": body.prompt_logprobs},
                    body.max_completion_tokens or body.max_tokens, body.chat_template_kwargs,
                    {"max_tokens": used, "constraint": "response_format", "logprobs": "top_logprobs"},
                    {"max_tokens": body.max_tokens} if used == "max_completion_tokens" else {},
                    priority=body.priority, client=f"user:{body.user}" if body.user else "", cache_salt=body.cache_salt,
                    unset=sampling_defaults.unset(body.model_fields_set), continue_final=body.continue_final_message,
                    add_generation_prompt=body.add_generation_prompt, chat_template=body.chat_template)
