"""The prompt's token ids, as every API makes them: chat messages through the chat template
(`encode_chat`), the completions API's prompts (`completion_prompts`), and the output bound of
a request that sets none (`default_max_tokens`)."""

from __future__ import annotations

from nextoken.errors import InvalidRequest
from nextoken.tokenizer.chat_template import open_final_message


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                template_kwargs: dict | None = None, continue_final: bool = False,
                add_generation_prompt: bool = True, template: str | None = None) -> list[int]:
    """Render `messages` with the chat template and tokenize, keeping any special-token text the
    user typed in a message (e.g. ``<|im_end|>``) as literal text rather than control tokens.
    `continue_final`: the last message (an assistant's prefill) is left open for the answer to
    go on from, in place of a generation prompt (`chat_template.open_final_message`);
    `add_generation_prompt` False: no generation prompt either way; `template`: a Jinja source in
    place of the model's template.

    The template's own text is tokenized with special tokens parsed; each message's content,
    located in the rendered text in order, is tokenized without."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt and not continue_final,
                                         tools=tools, extra=template_kwargs, template=template)
    contents = [m["content"] or "" for m in messages]
    if continue_final:
        text = open_final_message(text, messages, f"messages[{len(messages) - 1}].content")
        contents[-1] = contents[-1].strip()
    specials = tokenizer.special_texts
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
    room = max(1, min(engine.max_model_len, engine.kv_capacity) - num_prompt_tokens)
    return min(room, cap) if cap else room
