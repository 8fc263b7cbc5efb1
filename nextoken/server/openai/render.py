"""The OpenAI bodies of answers: chat.completion and text_completion objects, their chunks
(server-sent events) from the chat core's events or the engine's outputs, logprobs, usage."""

from __future__ import annotations

import asyncio
import logging

from nextoken.server.chat.events import Usage, Failed, Finish, Text, Thought, ToolCallArgs, ToolCallStart, Tokens
from nextoken.server.api.stream_json import stream_json

log = logging.getLogger("nextoken.server")


# -- logprobs -----------------------------------------------------------------------------------
def _name(tok, tid: int, as_ids: bool) -> str:
    """How a log-probability entry names token `tid`: its text, or with `as_ids` (vLLM's
    ``return_tokens_as_token_ids``, for tokens that are no text of their own) ``token_id:N``."""
    return f"token_id:{tid}" if as_ids else tok.token_text(tid)


def _entry(tok, tid: int, lp: float, as_ids: bool = False) -> dict:
    text = _name(tok, tid, as_ids)
    return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}


def _top(pos: dict[int, float], n: int) -> list[tuple[int, float]]:
    """The n most likely tokens of one position. (Its dict holds the top n and the chosen token,
    which may or may not be among them.)"""
    return sorted(pos.items(), key=lambda kv: -kv[1])[:n]


def chat_logprobs(tok, token_ids: list[int], logprobs: list[dict] | None, n: int, as_ids: bool = False) -> dict | None:
    if logprobs is None:
        return None
    content = []
    for tid, pos in zip(token_ids, logprobs):
        e = _entry(tok, tid, pos[tid], as_ids)
        e["top_logprobs"] = [_entry(tok, t, lp, as_ids) for t, lp in _top(pos, n)]
        content.append(e)
    return {"content": content}


def completion_logprobs(tok, token_ids, logprobs, n: int, offset: int = 0, as_ids: bool = False) -> dict | None:
    """The legacy ``logprobs`` object; each text offset counts the tokens' text before it, also
    where `as_ids` names the tokens ``token_id:N``."""
    if logprobs is None:
        return None
    tokens, lps, tops, offsets = [], [], [], []
    for tid, pos in zip(token_ids, logprobs):
        text = tok.token_text(tid)
        offsets.append(offset)
        offset += len(text)
        tokens.append(_name(tok, tid, as_ids))
        lps.append(None if pos is None else pos[tid])  # None: a prompt's first token (nothing before it)
        tops.append(None if pos is None else {_name(tok, t, as_ids): lp for t, lp in _top(pos, n)})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


# -- non-streaming ------------------------------------------------------------------------------
def usage(outs) -> dict:
    return usage_json(Usage.of(outs))


def completion_response(engine, body, outs, prompts, created: int, model: str) -> dict:
    tok = engine.tokenizer
    choices = []
    for i, (o, (ids, text)) in enumerate(zip(outs, prompts)):
        prefix = (text if text is not None else tok.decode(ids)) if body.echo else ""
        for c in o.outputs:
            lp = completion_logprobs(tok, c.token_ids, c.logprobs, body.logprobs or 0, len(prefix),
                                     bool(body.return_tokens_as_token_ids))
            if body.echo and body.logprobs is not None:
                lp = _join_logprobs(echo_logprobs(tok, ids, o.prompt_logprobs, body), lp)
            choice = {"index": i * body.n + c.index, "text": prefix + c.text, "logprobs": lp,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _prompt_logprobs_json(o.prompt_logprobs)
            if body.return_token_ids:
                choice["prompt_token_ids"], choice["token_ids"] = list(ids), list(c.token_ids)
            choices.append(choice)
    return {"id": outs[0].request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(outs)}


def echo_logprobs(tok, ids: list[int], prompt_logprobs, body) -> dict:
    """The legacy completions ``logprobs`` of the prompt's tokens (echo): each token's
    log-probability given the tokens before it and the top ``body.logprobs`` there; the first
    token's are None."""
    return completion_logprobs(tok, ids, prompt_logprobs or [None] * len(ids), body.logprobs, 0,
                               bool(body.return_tokens_as_token_ids))


def _join_logprobs(first: dict, second: dict | None) -> dict:
    if second is None:
        return first
    return {k: first[k] + second[k] for k in first}


def _prompt_logprobs_json(prompt_logprobs) -> list | None:
    """vLLM's ``prompt_logprobs``: per position ``{token_id: {"logprob", "rank"?}}`` or None."""
    if prompt_logprobs is None:
        return None
    return [None if pos is None else {str(t): {"logprob": lp} for t, lp in pos.items()} for pos in prompt_logprobs]


def chat_response(tok, body, res, created: int, model: str, reasoning: bool = False) -> dict:
    """A chat.completion of the core's `ChatResult` `res`: each choice's tool calls as
    ``message.tool_calls`` (finish_reason ``tool_calls``); with `reasoning` (the server has a
    reasoning parser) its thought as ``reasoning_content`` (and ``reasoning``)."""
    choices, echoed = [], body.echoed()
    for c in res.choices:
        message = {"role": "assistant", "content": echoed + c.text or (None if c.calls else "")}
        if reasoning:
            message["reasoning_content"] = message["reasoning"] = c.thought or None
        if c.calls:
            message["tool_calls"] = [_tool_call(call) for call in c.calls]
        choice = {"index": c.index, "message": message,
                  "logprobs": chat_logprobs(tok, c.token_ids, c.logprobs, body.top_logprobs or 0,
                                            bool(body.return_tokens_as_token_ids)),
                  "finish_reason": c.finish}
        if body.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        choices.append(choice)
    answer = {"id": res.request_id, "object": "chat.completion", "created": created, "model": model,
              "choices": choices, "usage": usage_json(res.usage)}
    if body.return_token_ids:
        answer["prompt_token_ids"] = list(res.output.prompt_token_ids)
    if body.prompt_logprobs is not None:  # vLLM's: the rendered prompt's, its first position None
        answer["prompt_logprobs"] = _prompt_logprobs_json(res.output.prompt_logprobs)
    return answer


def usage_json(u) -> dict:
    """OpenAI's usage object of a `chat.run.Usage`."""
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


# -- streaming ----------------------------------------------------------------------------------
def sse(obj) -> str:
    return f"data: {stream_json(obj)}\n\n"


DONE = "data: [DONE]\n\n"


def _tool_call(call) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


async def stream_chat(tok, body, events, rid: str, created: int, model: str, tools: bool,
                      prompt_ids: list[int] | None = None):
    """Chat chunks of the core's event stream: each step's text as ``delta.content`` (with its
    log-probabilities), the thought first as ``delta.reasoning_content``; with `tools` (the
    request offers some), calls as ``delta.tool_calls`` (id and name once, then argument pieces).
    With ``return_token_ids``, the first chunk carries `prompt_ids` and each step's last chunk of
    a choice its new token ids."""
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    for i in range(body.n):
        head = {"prompt_token_ids": list(prompt_ids or [])} if body.return_token_ids and i == 0 else {}
        yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": body.echoed()},
                                        "logprobs": None, "finish_reason": None}], **head})
    deltas: list[dict] = []  # this step's
    finish = last = None
    async for ev in events:
        if isinstance(ev, Failed):
            yield sse({"error": {"message": ev.message, "type": "server_error", "param": None, "code": 500}})
            break
        if isinstance(ev, Thought):  # the thought first, as its own deltas; the answer goes on
            yield sse({**base, "choices": [{"index": ev.index, "delta": {"reasoning_content": ev.text,
                                                                         "reasoning": ev.text},
                                            "logprobs": None, "finish_reason": None}]})
        elif isinstance(ev, Text):
            deltas.append({"content": ev.text})
        elif isinstance(ev, ToolCallStart):
            deltas.append({"tool_calls": [{"index": ev.call, "id": ev.id, "type": "function",
                                           "function": {"name": ev.name, "arguments": ""}}]})
        elif isinstance(ev, ToolCallArgs):
            deltas.append({"tool_calls": [{"index": ev.call, "function": {"arguments": ev.text}}]})
        elif isinstance(ev, Finish):
            finish = last = ev
        else:  # Tokens: the step's chunks
            for chunk in _step_chunks(tok, body, ev, deltas, finish, tools):
                yield sse({**base, "choices": [chunk]})
            deltas, finish = [], None
    else:
        if include_usage and last is not None:
            yield sse({**base, "choices": [], "usage": usage_json(last.usage)})
    yield DONE


def _step_chunks(tok, body, ev: Tokens, deltas: list[dict], finish, tools: bool) -> list[dict]:
    """The choices of one step's chunks: its deltas, the log-probabilities, finish reason (and
    with ``return_token_ids`` the token ids) on the last (without tools, the step's text as one
    delta, even an empty one)."""
    lp = chat_logprobs(tok, ev.token_ids, ev.logprobs, body.top_logprobs or 0,
                       bool(body.return_tokens_as_token_ids)) if ev.logprobs else None
    reason = finish.reason if finish is not None else None
    ids = list(ev.token_ids) if body.return_token_ids else None
    if not tools:
        text = "".join(d["content"] for d in deltas)
        deltas = [{"content": text} if text or finish is None else {}]
    elif not deltas:
        if finish is None and lp is None and not ids:
            return []  # text held back by the parser: nothing to send yet
        deltas = [{}]
    chunks = [{"index": ev.index, "delta": d, "logprobs": lp if k == len(deltas) - 1 else None,
               "finish_reason": reason if k == len(deltas) - 1 else None} for k, d in enumerate(deltas)]
    if ids is not None:
        chunks[-1]["token_ids"] = ids
    return chunks


async def _outputs(eng, rids: list[str], tasks: list):
    """``(k, output)`` of requests `rids` as the engine makes them (k: the prompt's place). One
    request is read straight from its stream (so outputs that wait for a slow writer arrive
    joined: `AsyncLLMEngine.stream`); several are pumped into one queue by a task each (in
    `tasks`, for the caller to cancel). Raises what a stream raises."""
    if len(rids) == 1:
        async for out in eng.stream(rids[0]):
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k, rid):
        try:
            async for out in eng.stream(rid):
                await queue.put((k, out))
        except Exception as exc:
            await queue.put((k, exc))
        finally:
            await queue.put((k, None))

    tasks.extend(asyncio.create_task(pump(k, rid)) for k, rid in enumerate(rids))
    live = len(rids)
    while live:
        k, out = await queue.get()
        if out is None:
            live -= 1
            continue
        if isinstance(out, Exception):
            raise out
        yield k, out


async def stream_completion(eng, body, rids: list[str], prompts, created: int, model: str, record):
    """text_completion chunks of requests `rids` as the engine makes them; `record([out])` takes each
    finished one (metrics and log line)."""
    tok = eng.tokenizer
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    tasks: list[asyncio.Task] = []
    finals, echoed, started = {}, set(), set()
    try:
        async for k, out in _outputs(eng, rids, tasks):
            for c in out.outputs:
                idx = k * body.n + c.index
                text, echo_lp = c.delta, None
                if body.echo and idx not in echoed:
                    ids, ptext = prompts[k]
                    text = (ptext if ptext is not None else tok.decode(ids)) + text
                    echoed.add(idx)
                    if body.logprobs is not None:
                        echo_lp = echo_logprobs(tok, ids, out.prompt_logprobs, body)
                if not text and not (c.finished and out.finished) and not (body.return_token_ids and c.delta_token_ids):
                    continue
                lp = completion_logprobs(tok, c.delta_token_ids, c.delta_logprobs, body.logprobs or 0, 0,
                                         bool(body.return_tokens_as_token_ids))
                if echo_lp is not None:
                    lp = _join_logprobs(echo_lp, lp if lp is not None and lp["tokens"] else None)
                choice = {"index": idx, "text": text, "logprobs": lp,
                          "finish_reason": c.finish_reason if out.finished else None}
                if body.return_token_ids:  # (vLLM's: the prompt's ids on each choice's first chunk)
                    if idx not in started:
                        choice["prompt_token_ids"] = list(prompts[k][0])
                    choice["token_ids"] = list(c.delta_token_ids)
                started.add(idx)
                yield sse({"id": rids[0], "object": "text_completion", "created": created, "model": model,
                           "choices": [choice]})
            if out.finished:
                finals[k] = out
                record([out])
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
