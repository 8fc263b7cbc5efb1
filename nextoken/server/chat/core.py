"""The chat core under every chat-like API (OpenAI chat, Responses, Anthropic Messages, Ollama
chat): each API turns its request into a `ChatSpec` (its `to_spec`), and `prepare` does the
steps they share, once, in one order:

    ChatSpec -> tools for the template (+ the grammar forcing a call: tool_choice "required" or
    a named tool) -> the prompt's token ids (chat template) -> max_tokens (the request's, checked
    against the context, or the server's --max-tokens-default bound) -> SamplingParams (checked
    against the vocabulary) -> the grammar compiled off the event loop -> `Prepared`

Errors name the request's own field (`ChatSpec.fields`: ``max_output_tokens`` on Responses,
``options.num_predict`` on Ollama, ...). What comes back out (the answer's shape, its stream) is
still each API's own module; the typed events that module reads are `ToolCallParser`'s and
`StreamSplitter`'s (`server.chat.tools`, `server.chat.reasoning`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nextoken.errors import InvalidRequest
from nextoken.sampling_defaults import SAMPLING_FIELDS
from nextoken.sampling_params import SamplingParams
from nextoken.server.chat import prompts
from nextoken.server.chat import rules as chat_rules, tools as tools_mod
from nextoken.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from nextoken.server.api.serving import ApiServing

# the neutral names of the fields an API may call otherwise (`ChatSpec.fields`)
FIELDS = ("max_tokens", "tool_choice", "constraint", "tools", "sampling", "priority")


@dataclass
class ChatSpec:
    """One chat request in API-neutral terms.

    messages: OpenAI chat messages (role, content, tool_calls with JSON-text arguments,
    tool_call_id); tools: OpenAI chat tools (``{"type": "function", "function": {name,
    description, parameters}}``) or None; tool_choice: "auto", "none", "required", or a tool's
    name (None: "auto"); parallel_tool_calls: whether a forced answer may hold several calls;
    constraint: the output format asked for (a JSON schema, json_object, ...) or None;
    sampling: `SamplingParams` fields but max_tokens and structured_outputs (min_tokens is
    clamped to max_tokens); max_tokens: the request's output bound, or None for the server's;
    template_kwargs: more chat-template variables; fields: the request's name for each of
    `FIELDS` where it differs, for errors; other_bounds: output bounds the request also names
    but does not use (field -> value: OpenAI chat's max_tokens beside max_completion_tokens),
    each checked against the context as max_tokens is; prompt_ids: the prompt's token ids as
    they are (a raw prompt: no template, no tools; `messages` unused); priority: its scheduling
    priority (lower first; `RequestOptions.priority`); client: who sent it, for the fair policy
    (the request's ``user``; empty: the caller's API key, `serving.client_of`); unset: the
    sampling fields the request left to their defaults, which take the model's where it has
    some (`nextoken.sampling_defaults`; all of them by default); continue_final: the last
    message is an assistant's prefill, which the answer continues (Anthropic's and Ollama's
    rule) instead of a new turn; add_generation_prompt: the template's opening of the answer's
    turn (vLLM's switch; off with continue_final); chat_template: a Jinja source used in place
    of the model's (vLLM's request field; the server decides whether to take it); cache_salt:
    `RequestOptions.cache_salt`."""

    messages: list[dict]
    tools: list[dict] | None = None
    tool_choice: str | None = None
    parallel_tool_calls: bool = True
    constraint: StructuredOutputsParams | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    template_kwargs: dict | None = None
    fields: dict[str, str] = field(default_factory=dict)
    other_bounds: dict[str, int] = field(default_factory=dict)
    prompt_ids: list[int] | None = None
    priority: int = 0
    client: str = ""
    unset: frozenset[str] = frozenset(SAMPLING_FIELDS)
    continue_final: bool = False
    add_generation_prompt: bool = True
    chat_template: str | None = None
    cache_salt: str | None = None

    def name(self, neutral: str) -> str:
        return self.fields.get(neutral, neutral)


@dataclass
class Prepared:
    """What the engine gets and what the answer is parsed with: the prompt's ids, the sampling
    parameters, the template's tools (None without) and their names (the tool-call parser's),
    the scheduling priority, client and cache salt (`ChatSpec`'s)."""

    ids: list[int]
    params: SamplingParams
    tools: list[dict] | None
    names: frozenset[str] | None
    priority: int = 0
    client: str = ""
    cache_salt: str | None = None


async def prepare(serving: ApiServing, spec: ChatSpec) -> Prepared:
    """`spec` as a request ready for the engine of `serving` (its `EngineClient`). Raises
    `InvalidRequest` naming the request's field: a tool_choice without tools or naming none of
    them, a forced call beside an output format, tools on a template that cannot render them,
    max_tokens that leaves no room for the prompt, an invalid sampling value or grammar."""
    engine = serving.engine
    ids, tools, forced = render(engine.tokenizer, spec)
    for name, bound in {spec.name("max_tokens"): spec.max_tokens, **spec.other_bounds}.items():
        if bound is not None and bound >= engine.max_model_len:
            raise InvalidRequest(f"{name} is {bound}: no room for the prompt in the context length "
                                 f"{engine.max_model_len} (max_model_len)", name)
    defaults = engine.sampling_defaults
    max_tokens = spec.max_tokens or min(prompts.default_max_tokens(engine, len(ids), serving.args.max_tokens_default),
                                        defaults.get("max_tokens") or engine.max_model_len)
    sampling = {**spec.sampling, **{k: v for k, v in defaults.items() if k in spec.unset}}
    if "min_tokens" in sampling:
        sampling["min_tokens"] = min(sampling["min_tokens"], max_tokens)
    try:
        params = SamplingParams(**sampling, max_tokens=max_tokens, structured_outputs=forced or spec.constraint)
        params = params.validate(engine.config.vocab_size, engine.max_logprobs)
    except (TypeError, InvalidRequest) as exc:
        raise _sampling_error(spec, exc) from None
    await serving.compile(params.structured_outputs)
    names = frozenset(t["function"]["name"] for t in tools) if tools else None
    if isinstance(spec.priority, bool) or not isinstance(spec.priority, int):
        raise InvalidRequest(f"{spec.name('priority')} must be an integer, got {spec.priority!r}", spec.name("priority"))
    return Prepared(ids, params, tools, names, spec.priority, spec.client, spec.cache_salt)


def _sampling_error(spec: ChatSpec, exc: Exception) -> InvalidRequest:
    """A sampling value's error, its field under the request's own name for the sampling fields
    (``options.top_p`` on Ollama)."""
    where = spec.fields.get("sampling")
    field = getattr(exc, "field", None)
    if where is None and field and spec.name(field) != field:  # (OpenAI chat's top_logprobs is logprobs here)
        return InvalidRequest(str(exc).replace(field, spec.name(field), 1), spec.name(field))
    if where is None:
        return exc if isinstance(exc, InvalidRequest) else InvalidRequest(str(exc))
    if field in ("max_tokens", "structured_outputs"):  # not a sampling field: the request's own name
        return InvalidRequest(str(exc), spec.name("max_tokens" if field == "max_tokens" else "constraint"))
    name = f"{where}.{field}" if field else where
    return InvalidRequest(f"{name}: {exc}", name)


def prefilled(messages: list[dict]) -> tuple[list[dict], bool]:
    """Anthropic's and Ollama's rule for a conversation that ends with an assistant message
    without tool calls (a prefill): the answer goes on from it. ``(messages, continue_final)``
    for `ChatSpec`; a final assistant message with no text is dropped (the answer is a new
    turn, as without it)."""
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant" or last.get("tool_calls"):
        return messages, False
    if not (last.get("content") or "").strip():
        return messages[:-1], False
    return messages, True


def render(tok, spec: ChatSpec) -> tuple[list[int], list[dict] | None, StructuredOutputsParams | None]:
    """(the prompt's token ids, the template's tools or None, the grammar forcing a call or
    None) of `spec` with tokenizer `tok`; raises `InvalidRequest` as `prepare` does."""
    chat_rules.check(spec)
    if spec.prompt_ids is not None:
        return spec.prompt_ids, None, None
    tools, forced = _tool_setup(spec, tok)
    messages = tools_mod.messages_for_template(spec.messages)
    ids = prompts.encode_chat(tok, messages, tools, spec.template_kwargs, spec.continue_final,
                              spec.add_generation_prompt and not spec.continue_final, spec.chat_template)
    return ids, tools, forced


def _tool_setup(spec: ChatSpec, tok) -> tuple[list[dict] | None, StructuredOutputsParams | None]:
    """(tools for the template or None, the grammar forcing calls or None)."""
    choice = spec.tool_choice or "auto"
    if not spec.tools or choice == "none":  # (a forcing choice without tools: `chat.rules`)
        return None, None
    tools_mod.require_tool_template(spec.chat_template or tok.chat_template)
    if choice == "auto":
        return spec.tools, None
    name = None if choice == "required" else choice
    if name is not None and name not in {t["function"]["name"] for t in spec.tools}:
        raise InvalidRequest(f"tool_choice names function {name!r}, which is not among the tools",
                             spec.name("tool_choice"))
    return spec.tools, tools_mod.forced_grammar(tok, spec.tools, name, spec.parallel_tool_calls)


def append_call(messages: list[dict], call_id: str, name: str, arguments: str) -> None:
    """A tool call onto the conversation: into the last assistant message's calls, or a new one."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls") is not None:
        messages[-1]["tool_calls"].append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
