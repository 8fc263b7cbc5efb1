"""Building OpenAI-shaped responses (JSON and server-sent-event chunks) from engine outputs."""

from __future__ import annotations

import asyncio
import json
import logging

from nextoken.errors import InvalidRequest
from nextoken.server.reasoning import StreamSplitter, split as split_reasoning
from nextoken.server.tools import parse as parse_tools

log = logging.getLogger("nextoken.server")


# -- prompts ------------------------------------------------------------------------------------
def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                template_kwargs: dict | None = None) -> list[int]:
    """Render `messages` with the chat template and tokenize, keeping any special-token text the
    user typed in a message (e.g. ``<|im_end|>``) as literal text rather than control tokens.

    The template's own text is tokenized with special tokens parsed; each message's content,
    located in the rendered text in order, is tokenized without."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools, extra=template_kwargs)
    specials = tokenizer.special_texts
    contents = [m["content"] or "" for m in messages]
    if not any(s in c for c in contents for s in specials):
        return tokenizer.encode(text)
    ids, pos = [], 0
    for k, c in enumerate(contents):
        if not c:
            continue
        i = text.find(c, pos)
        if i < 0:
            raise InvalidRequest(f"messages[{k}].content holds special-token text that the chat template "
                                 "changes; remove it", f"messages[{k}].content")
        ids += tokenizer.encode(text[pos:i], add_bos=False) + tokenizer.encode(c, add_bos=False, parse_special=False)
        pos = i + len(c)
    return ids + tokenizer.encode(text[pos:], add_bos=False)


def completion_prompts(engine, prompt) -> list[tuple[list[int], str | None]]:
    """``(ids, text)`` for each prompt of a /v1/completions request (a string, strings, ids, or
    lists of ids)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    if not prompt:
        raise InvalidRequest("prompt must not be empty", "prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append((engine.tokenizer.encode(p), p))
        else:
            out.append((list(p), None))
    return out


def default_max_tokens(engine, num_prompt_tokens: int, cap: int | None = None) -> int:
    """max_tokens for a request that gives none (chat, responses, Ollama): the rest of the
    context window, or of the KV cache if that is smaller, and at most `cap` (the server's
    ``--max-tokens-default``, 4096 unless set)."""
    room = max(1, min(engine.max_model_len, engine.kv.pool.num_blocks * engine.kv.block_size) - num_prompt_tokens)
    return min(room, cap) if cap else room


# -- logprobs -----------------------------------------------------------------------------------
def _entry(tok, tid: int, lp: float) -> dict:
    text = tok.token_text(tid)
    return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}


def _top(pos: dict[int, float], n: int) -> list[tuple[int, float]]:
    """The n most likely tokens of one position. (Its dict holds the top n and the chosen token,
    which may or may not be among them.)"""
    return sorted(pos.items(), key=lambda kv: -kv[1])[:n]


def chat_logprobs(tok, token_ids: list[int], logprobs: list[dict] | None, n: int) -> dict | None:
    if logprobs is None:
        return None
    content = []
    for tid, pos in zip(token_ids, logprobs):
        e = _entry(tok, tid, pos[tid])
        e["top_logprobs"] = [_entry(tok, t, lp) for t, lp in _top(pos, n)]
        content.append(e)
    return {"content": content}


def completion_logprobs(tok, token_ids, logprobs, n: int, offset: int = 0) -> dict | None:
    if logprobs is None:
        return None
    tokens, lps, tops, offsets = [], [], [], []
    for tid, pos in zip(token_ids, logprobs):
        text = tok.token_text(tid)
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        lps.append(None if pos is None else pos[tid])  # None: a prompt's first token (nothing before it)
        tops.append(None if pos is None else {tok.token_text(t): lp for t, lp in _top(pos, n)})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


# -- non-streaming ------------------------------------------------------------------------------
def usage(outs) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.metrics.num_cached_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion_response(engine, body, outs, prompts, created: int, model: str) -> dict:
    tok = engine.tokenizer
    choices = []
    for i, (o, (ids, text)) in enumerate(zip(outs, prompts)):
        prefix = (text if text is not None else tok.decode(ids)) if body.echo else ""
        for c in o.outputs:
            lp = completion_logprobs(tok, c.token_ids, c.logprobs, body.logprobs or 0, len(prefix))
            if body.echo and body.logprobs is not None:
                lp = _join_logprobs(echo_logprobs(tok, ids, o.prompt_logprobs, body.logprobs), lp)
            choice = {"index": i * body.n + c.index, "text": prefix + c.text, "logprobs": lp,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _prompt_logprobs_json(o.prompt_logprobs)
            choices.append(choice)
    return {"id": outs[0].request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(outs)}


def echo_logprobs(tok, ids: list[int], prompt_logprobs, n: int) -> dict:
    """The legacy completions ``logprobs`` of the prompt's tokens (echo): each token's
    log-probability given the tokens before it and the top `n` there; the first token's are None."""
    return completion_logprobs(tok, ids, prompt_logprobs or [None] * len(ids), n)


def _join_logprobs(first: dict, second: dict | None) -> dict:
    if second is None:
        return first
    return {k: first[k] + second[k] for k in first}


def _prompt_logprobs_json(prompt_logprobs) -> list | None:
    """vLLM's ``prompt_logprobs``: per position ``{token_id: {"logprob", "rank"?}}`` or None."""
    if prompt_logprobs is None:
        return None
    return [None if pos is None else {str(t): {"logprob": lp} for t, lp in pos.items()} for pos in prompt_logprobs]


def chat_response(engine, body, out, created: int, model: str, tools: frozenset[str] | None = None,
                  reasoning: str | None = None) -> dict:
    """A chat.completion; with `tools` (the request's tool names), each answer's text is parsed
    for tool calls (`tools.parse`), which become ``message.tool_calls`` and finish_reason
    ``tool_calls``; with `reasoning` (a `server.reasoning` style) the thought goes to
    ``reasoning_content`` (and ``reasoning``), the rest is the answer."""
    tok = engine.tokenizer
    choices = []
    for c in out.outputs:
        thought, text = split_reasoning(c.text, reasoning) if reasoning else (None, c.text)
        message, finish = {"role": "assistant", "content": text}, c.finish_reason
        if reasoning:
            message["reasoning_content"] = message["reasoning"] = thought or None
        if tools:
            parsed = parse_tools(text, tools, c.finish_reason == "length")
            message["content"] = parsed.content or (None if parsed.calls else "")
            if parsed.calls:
                message = {**message, "content": parsed.content or None,
                           "tool_calls": [_tool_call(call) for call in parsed.calls]}
                finish = "tool_calls" if finish == "stop" else finish
        choices.append({"index": c.index, "message": message,
                        "logprobs": chat_logprobs(tok, c.token_ids, c.logprobs, body.top_logprobs or 0),
                        "finish_reason": finish})
    return {"id": out.request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage([out])}


# -- streaming ----------------------------------------------------------------------------------
def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


def _tool_call(call) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _tool_deltas(events, parser) -> list[dict]:
    """OpenAI chat deltas for `ToolCallParser` events: content text, a call's id and name (once),
    then pieces of its arguments."""
    deltas = []
    for ev in events:
        if ev[0] == "content":
            deltas.append({"content": ev[1]})
        elif ev[0] == "call":
            call = parser.calls[ev[1]]
            deltas.append({"tool_calls": [{"index": ev[1], "id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
        else:
            deltas.append({"tool_calls": [{"index": ev[1], "function": {"arguments": ev[2]}}]})
    return deltas


async def stream_chat(eng, body, rid: str, created: int, model: str, metrics, tools: frozenset[str] | None = None,
                      reasoning: str | None = None):
    """Chat chunks as the engine produces them; with `tools`, text goes through a
    `ToolCallParser` per choice and tool calls go out as ``delta.tool_calls``; with `reasoning`,
    a `ReasoningParser` per choice sends the thought as ``delta.reasoning_content`` first."""
    tok = eng.engine.tokenizer
    splitters = [StreamSplitter(reasoning, tools) for _ in range(body.n)]
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    try:
        for i in range(body.n):
            yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
        out = None
        async for out in eng.stream(rid):
            for c in out.outputs:
                if not c.delta and not c.delta_token_ids and not (c.finished and out.finished):
                    continue
                lp = chat_logprobs(tok, c.delta_token_ids, c.logprobs[-len(c.delta_token_ids):]
                                   if c.logprobs is not None and c.delta_token_ids else None, body.top_logprobs or 0)
                thought, events = splitters[c.index].feed(c.delta, c.finished, c.finish_reason == "length")
                for piece in thought:  # the thought first, as its own deltas; the answer goes on
                    yield sse({**base, "choices": [{"index": c.index, "delta": {
                        "reasoning_content": piece, "reasoning": piece}, "logprobs": None, "finish_reason": None}]})
                p = splitters[c.index].parser
                if p is None:
                    text = "".join(piece for _, piece in events)
                    delta = {"content": text} if text or not c.finished else {}
                    yield sse({**base, "choices": [{"index": c.index, "delta": delta, "logprobs": lp,
                                                    "finish_reason": c.finish_reason}]})
                    continue
                deltas = _tool_deltas(events, p)
                if not deltas:
                    if not c.finished and lp is None:
                        continue  # text held back by the parser: nothing to send yet
                    deltas = [{}]
                finish = "tool_calls" if c.finish_reason == "stop" and p.calls else c.finish_reason
                for k, delta in enumerate(deltas):
                    last = k == len(deltas) - 1
                    yield sse({**base, "choices": [{"index": c.index, "delta": delta,
                                                    "logprobs": lp if last else None,
                                                    "finish_reason": finish if last else None}]})
        if include_usage and out is not None:
            yield sse({**base, "choices": [], "usage": usage([out])})
        if out is not None:
            metrics.observe(out)
            log_request(out)
        yield DONE
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # an engine failure after the 200 went out: say so in the stream
        log.exception("stream failed")
        yield sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": 500}})
        yield DONE


async def stream_completion(eng, body, rids: list[str], prompts, created: int, model: str, metrics):
    tok = eng.engine.tokenizer
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k, rid):
        try:
            async for out in eng.stream(rid):
                await queue.put((k, out))
        except Exception as exc:
            await queue.put((k, exc))
        finally:
            await queue.put((k, None))

    tasks = [asyncio.create_task(pump(k, rid)) for k, rid in enumerate(rids)]
    finals, live = {}, len(rids)
    echoed = set()
    try:
        while live:
            k, out = await queue.get()
            if out is None:
                live -= 1
                continue
            if isinstance(out, Exception):
                raise out
            for c in out.outputs:
                idx = k * body.n + c.index
                text, echo_lp = c.delta, None
                if body.echo and idx not in echoed:
                    ids, ptext = prompts[k]
                    text = (ptext if ptext is not None else tok.decode(ids)) + text
                    echoed.add(idx)
                    if body.logprobs is not None:
                        echo_lp = echo_logprobs(tok, ids, out.prompt_logprobs, body.logprobs)
                if not text and not (c.finished and out.finished):
                    continue
                lp = completion_logprobs(tok, c.delta_token_ids, c.logprobs[-len(c.delta_token_ids):]
                                         if c.logprobs is not None and c.delta_token_ids else None,
                                         body.logprobs or 0)
                if echo_lp is not None:
                    lp = _join_logprobs(echo_lp, lp if lp is not None and lp["tokens"] else None)
                yield sse({"id": rids[0], "object": "text_completion", "created": created, "model": model,
                           "choices": [{"index": idx, "text": text, "logprobs": lp,
                                        "finish_reason": c.finish_reason if out.finished else None}]})
            if out.finished:
                finals[k] = out
                metrics.observe(out)
                log_request(out)
        if include_usage:
            yield sse({"id": rids[0], "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": usage([finals[k] for k in sorted(finals)])})
        yield DONE
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("stream failed")
        yield sse({"error": {"message": str(exc), "type": "server_error", "param": None, "code": 500}})
        yield DONE
    finally:
        for t in tasks:
            t.cancel()
        for rid in rids:
            eng.abort(rid)


def log_request(out) -> None:
    """One log line per finished request: id, tokens in and out, TTFT, total time."""
    m = out.metrics
    total = (m.finished_time - m.arrival_time) if m.finished_time else float("nan")
    ttft = f"{m.ttft:.3f}s" if m.ttft is not None else "-"
    log.info("request %s prompt_tokens=%d output_tokens=%d ttft=%s total=%.3fs finish=%s", out.request_id,
             m.num_prompt_tokens, m.num_output_tokens, ttft, total,
             ",".join(str(c.finish_reason) for c in out.outputs))
