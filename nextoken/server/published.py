"""The fields of each API's published request schema that change nothing on this server: each
request model drops them before validation (`bodies.accept_published`), at the values that mean
nothing here; another value is a 400 naming the field and the value. The guide's table lists
them from here (a test holds it to these tables), and a test sends every optional field of each
published schema (the `openai` and `anthropic` SDKs' request types) alone."""

from __future__ import annotations

from nextoken.bodies import Published, unset_or

CACHE = Published("prompt caching here is automatic (the prefix cache), keyed by content")
ACCOUNT = Published("an account, billing or abuse-monitoring label: this server has none")
TIER = Published("a provider's service tier or region: one server, one tier")
HINT = Published("a hint about cost or style that this server's models do not take")


def _empty_or_unset(value) -> bool:
    return value is None or value == [] or value == {}


# POST /v1/chat/completions (the `openai` SDK's CompletionCreateParams)
CHAT = {
    "store": Published("stored completions are OpenAI's distillation store: nothing is stored here"),
    "metadata": Published("labels for stored completions (nothing is stored)"),
    "prompt_cache_key": CACHE, "prompt_cache_retention": CACHE, "prompt_cache_options": CACHE,
    "safety_identifier": ACCOUNT, "moderation": ACCOUNT,
    "service_tier": TIER,
    "reasoning_effort": HINT, "verbosity": HINT,
    "prediction": Published("predicted outputs only speed a provider up; the output is the same"),
    "modalities": Published("text is the only output", unset_or(["text"]), "only [\"text\"] output is produced"),
    "audio": Published("audio output", _empty_or_unset, "audio output is not produced"),
    "web_search_options": Published("web search", _empty_or_unset, "web search is not available here"),
    "functions": Published("the deprecated form of tools", _empty_or_unset, "send them as tools"),
    "function_call": Published("the deprecated form of tool_choice", unset_or("none", "auto"),
                               "send tool_choice instead"),
}

# POST /v1/responses (the `openai` SDK's ResponseCreateParams)
RESPONSES = {
    "prompt_cache_key": CACHE, "prompt_cache_retention": CACHE, "prompt_cache_options": CACHE,
    "safety_identifier": ACCOUNT, "moderation": ACCOUNT, "access_programs": ACCOUNT,
    "service_tier": TIER,
    "reasoning": HINT,
    "stream_options": Published("include_obfuscation pads events against side channels; a local server has none"),
    "background_options": Published("options of background mode", _empty_or_unset, "background mode is not available"),
    "image": Published("image generation options", _empty_or_unset, "image generation is not available"),
    "background": Published("background mode", unset_or(False), "a response runs while its request is open"),
    "conversation": Published("OpenAI's Conversations API", unset_or(), "use previous_response_id"),
    "prompt": Published("a stored prompt template", unset_or(), "send the instructions and input"),
    "context_management": Published("server-side compaction", _empty_or_unset, "context compaction is not available"),
    "truncation": Published("'auto' drops old input to fit the context", unset_or("disabled"),
                            "a prompt past the context is refused, never truncated"),
}

# POST /v1/messages (the `anthropic` SDK's MessageCreateParams)
MESSAGES = {
    "cache_control": CACHE,
    "service_tier": TIER, "inference_geo": TIER, "speed": TIER,
    "workspace_id": ACCOUNT, "user_profile_id": ACCOUNT,
    "diagnostics": Published("request diagnostics a provider collects"),
    "thinking": Published("a thinking budget: a reasoning model here thinks as its chat template has it (the "
                          "server's --reasoning-parser returns the thought as thinking blocks)"),
    "container": Published("code execution containers", unset_or(), "code execution is not available"),
    "output_config": Published("effort and output format settings", _empty_or_unset,
                               "output_config is not supported: use tools for structured output"),
}

# POST /api/chat (Ollama's ChatRequest, as the `ollama` package types it)
LOGPROBS = Published("log-probabilities of the output", unset_or(False), "log-probabilities are not returned here")
TOP_LOGPROBS = Published("alternatives' log-probabilities", unset_or(0), "log-probabilities are not returned here")
OLLAMA_CHAT = {"logprobs": LOGPROBS, "top_logprobs": TOP_LOGPROBS}

# POST /api/generate (Ollama's GenerateRequest)
GENERATE = {
    "logprobs": LOGPROBS, "top_logprobs": TOP_LOGPROBS,
    "width": Published("image generation", unset_or(), "image generation is not available"),
    "height": Published("image generation", unset_or(), "image generation is not available"),
    "steps": Published("image generation", unset_or(), "image generation is not available"),
    "suffix": Published("fill-in-the-middle text after the answer", unset_or(""), "fill-in-the-middle is not supported"),
    "template": Published("a prompt template replacing the model's", unset_or(""), "the model's template is used"),
    "context": Published("the deprecated token context of an earlier answer", _empty_or_unset,
                         "send the conversation to /api/chat"),
}

TABLES = {"POST /v1/chat/completions": CHAT, "POST /v1/responses": RESPONSES, "POST /v1/messages": MESSAGES,
          "POST /api/chat": OLLAMA_CHAT, "POST /api/generate": GENERATE}


def guide_table() -> str:
    """The guide's table of these fields (docs/guide.md, between its ``published-fields``
    markers; ``python -m nextoken.server.published`` prints it)."""
    import json

    rows = ["| route | field | why it changes nothing | values accepted |", "|---|---|---|---|"]
    for route, table in TABLES.items():
        for field, e in table.items():
            if all(e.allows(v) for v in (True, 1, "x", ["x"], {"k": "x"})):
                accepted = "any"
            else:
                accepted = ", ".join(["unset"] + [f"`{json.dumps(v)}`" for v in (False, 0, "", [], {}, ["text"],
                                                                                   "disabled", "none", "auto")
                                                  if e.allows(v)])
            rows.append(f"| `{route}` | `{field}` | {e.note} | {accepted} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(guide_table(), end="")
