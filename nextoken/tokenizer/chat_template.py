"""Chat templates: the model's Jinja template, rendered in a sandbox.

Templates come from the model file, so they are untrusted code: they render in Jinja's
``ImmutableSandboxedEnvironment`` (no attribute access to Python internals, no mutation of the
inputs), with the same settings and helpers as Hugging Face's ``apply_chat_template``
(``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``strftime_now``).
"""

from __future__ import annotations

import datetime
import json
from functools import lru_cache

from nextoken.errors import InvalidRequest

ROLES = ("system", "user", "assistant", "tool")


def _raise_exception(message: str):
    raise InvalidRequest(f"chat template rejected the messages: {message}", "messages")


@lru_cache(maxsize=8)
def _compile(source: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """`transformers`' ``tojson`` (templates are written against it): plain ``json.dumps``,
    keys in order and no HTML escaping, unlike Jinja's own filter."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def chat_prompt(tokenizer, prompt: str | list[dict], system: str | None = None, template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: list[dict] | None = None, extra: dict | None = None) -> str:
    """The prompt text of a conversation (a message list, or one user message as a string) by the
    tokenizer's chat template (or `template`, a Jinja source), with `system` put first as a
    system message when given, `tools` and the template variables `extra` (as `render`). With
    `continue_final_message` (and `add_generation_prompt` off) the text ends where the last
    message's content does, so that the answer goes on from it (Hugging Face's and vLLM's rule:
    the rendered text up to the last occurrence of that content). Raises `InvalidRequest` for
    malformed messages, both switches on, or a last message whose content the rendered text
    does not hold."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    messages = validate_messages(list(messages))
    if system is not None:
        messages = [{"role": "system", "content": system}, *messages]
    if continue_final_message and add_generation_prompt:
        raise InvalidRequest("continue_final_message continues the last message: it needs add_generation_prompt "
                             "off", "continue_final_message")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt, tools, extra, template)
    return open_final_message(text, messages) if continue_final_message else text


def open_final_message(text: str, messages: list[dict], where: str = "continue_final_message") -> str:
    """`text` (the rendered `messages`, without a generation prompt) up to the end of the last
    message's content, whitespace stripped: the last message left open, so that an answer goes
    on from it (Hugging Face's ``continue_final_message`` rule). Raises `InvalidRequest` naming
    `where` when the rendered text does not hold that content."""
    final = (messages[-1]["content"] or "").strip()
    end = text.rfind(final) if final else -1
    if end < 0:
        raise InvalidRequest("the chat template does not render the last message's content as given, so it cannot "
                             "be continued", where)
    return text[: end + len(final)]


def validate_messages(messages) -> list[dict]:
    """Check `messages` is a non-empty list of ``{"role", "content"}`` with known roles and
    string content; raise `InvalidRequest` naming the bad element otherwise."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise InvalidRequest(f"messages[{i}] must have 'role' and 'content'", f"messages[{i}]")
        if m["role"] not in ROLES:
            raise InvalidRequest(
                f"messages[{i}].role is {m['role']!r}; allowed: {', '.join(ROLES)}",
                f"messages[{i}].role",
            )
        if not isinstance(m["content"], str):
            raise InvalidRequest(f"messages[{i}].content must be a string", f"messages[{i}].content")
    return messages


RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")


def render(source: str, messages: list[dict], add_generation_prompt: bool = True,
           bos_token: str = "", eos_token: str = "", tools: list[dict] | None = None,
           extra: dict | None = None) -> str:
    """Render chat template `source` over `messages` (and `tools`, OpenAI function tools, for
    templates that render them) to the prompt text; `extra`: more variables for the template
    (a request's ``chat_template_kwargs``, e.g. ``enable_thinking``).

    Raises `InvalidRequest` for malformed messages, an `extra` name the renderer sets itself, or a
    template that rejects them.
    """
    validate_messages(messages)
    clash = [k for k in extra or {} if k in RESERVED]
    if clash:
        raise InvalidRequest(f"chat_template_kwargs cannot set {clash[0]!r}", "chat_template_kwargs")
    try:
        return _compile(source).render(
            **(extra or {}), messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=bos_token, eos_token=eos_token, tools=tools,
        )
    except InvalidRequest:
        raise
    except Exception as exc:  # a template error is the model file's fault, reported plainly
        raise InvalidRequest(f"chat template failed to render: {type(exc).__name__}: {exc}",
                             "messages") from None
