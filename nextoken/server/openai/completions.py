"""``POST /v1/completions`` (as vLLM's ``OpenAIServingCompletion``): prompts in, one request per
prompt into the engine, the choices back as JSON or as server-sent events."""

from __future__ import annotations

import time

from fastapi import Request

from nextoken.request_options import RequestOptions
from nextoken.server.openai import render as R
from nextoken.server.openai.protocol import CompletionRequest
from nextoken.server.chat.prompts import completion_prompts
from nextoken.server.api.serving import ApiServing, client_of, new_request_id, no_lora_beams, sse_response


class OpenAIServingCompletion(ApiServing):
    async def create(self, body: CompletionRequest, request: Request):
        """The response to `body`. Raises `InvalidRequest` for a bad request (naming the field),
        `NotFound` for another model, `QueueFull` when too many wait."""
        lora = self.check_model(body.model)
        body.check_rules()
        self.check_queue()
        if body.return_tokens_as_token_ids is None:
            body.return_tokens_as_token_ids = self.args.return_tokens_as_token_ids
        eng = self.engine
        prompts = completion_prompts(eng, body.prompt)
        structured = body.structured()
        await self.compile(structured)
        if body.use_beam_search:
            no_lora_beams(lora)
            outs = await self.beam(body, [ids for ids, _ in prompts], body.generation_limit(), request)
            return R.completion_response(eng, body, outs, prompts, int(time.time()), self.args.model_name)
        rids = []
        client = f"user:{body.user}" if body.user else client_of(request)
        try:
            for ids, text in prompts:
                params = body.sampling_params(body.generation_limit(), body.logprobs, structured,
                                              body.scored_prompt(), eng.sampling_defaults)
                rids.append(await eng.add_request(ids, params, new_request_id("cmpl-", request),
                                                  RequestOptions(prompt_text=text, lora_request=lora,
                                                                 priority=body.priority, client=client,
                                                                 cache_salt=body.cache_salt,
                                                                 final_only=not body.stream)))
        except BaseException:
            for rid in rids:
                eng.abort(rid)
            raise
        created = int(time.time())
        if body.stream:
            return sse_response(R.stream_completion(eng, body, rids, prompts, created, self.args.model_name,
                                                    self.record))
        outs = await self.collect(rids, request)
        self.record(outs)
        return R.completion_response(eng, body, outs, prompts, created, self.args.model_name)
