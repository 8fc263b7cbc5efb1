"""The refusals of schema-valid requests that JSON Schema cannot state (they depend on tokenizing
the text, compiling what the user sent, or the server's state), each with how its 400 message
reads: tests/openapi_contract_hooks.py lets schemathesis accept them, and the contract tests check
that the patterns stay narrow. Kept apart from the hooks so that pytest never imports schemathesis
(its pytest plugin's modules are all rewritten for assertions on import: about 4 s per worker)."""

from __future__ import annotations

import re

SEMANTIC = {
    # prompt tokens + max_tokens past the context window (counts only known after tokenizing)
    "context": re.compile(r"prompt has (\d+) tokens and max_tokens is (\d+): (\d+) > the context length (\d+)"),
    "trace cap": re.compile(r"prompt has (\d+) tokens; traces take at most (\d+)$"),
    # the inspector's embedding widgets take words that are one token of the vocabulary
    "single token": re.compile(r"is not a single token of this model's vocabulary"),
    # a regex, grammar or JSON schema that llguidance cannot compile
    "constraint compiles": re.compile(r"^(guided_\w+|response_format|structured_outputs|json_schema) "
                                      r"(cannot be used|is not valid): "),
    # a JSON schema given as text must parse to an object
    "schema text": re.compile(r"^the JSON schema (is not valid JSON|must be an object)"),
    # logit_bias keys are decimal token ids; the schema cannot bound a key's value
    "logit_bias key": re.compile(r"^logit_bias: \d+ is not a token id in the vocabulary"),
    # the loaded model's chat template renders no tools
    "template tools": re.compile(r"^this model's chat template has no tool-call support"),
    # a named tool_choice must name one of the request's tools (a cross-reference)
    "tool name": re.compile(r"^tool_choice names function .* which is not among the tools$"),
    # LoRA routes on a server started without --enable-lora (the server's state, not the body)
    "lora off": re.compile(r"^this engine serves no LoRA adapters; start it with enable_lora=True"),
    # an adapter folder that does not exist on the server (a path the schema cannot check)
    # (any path; the name as Python's repr quotes it)
    "adapter folder": re.compile(r"^adapter ('.*'|\".*\"): .+ is missing \(a PEFT adapter folder has "),
    # n <= best_of (a comparison of two fields)
    "n <= best_of": re.compile(r"^n \(\d+\) must not exceed best_of \(\d+\) with use_beam_search$"),
    # the inspector's sampling view takes one constraint, and its generated tokens must follow it
    "one constraint": re.compile(r"^give json_schema or regex, not both$"),
    "grammar refuses generated": re.compile(r"^generated token \d+ \(position \d+\) is refused by the grammar"),
    # quantization's cost scores each position on the next token: a one-token prompt has none
    "two tokens": re.compile(r"^the prompt needs at least 2 tokens"),
    # a Responses input of MCP approval items alone, with no previous response (a cross-reference)
    "nothing to answer": re.compile(r"^input holds nothing to answer: MCP approval items alone continue "),
    # activation patching needs two prompts of as many tokens, answering differently (tokenizing, a pass)
    "patch prompts": re.compile(r"^(the prompts must have as many tokens: \d+ and \d+|both prompts answer .*: "
                                r"nothing to restore)$"),
    # an MCP server URL outside the server's --allow-mcp-url patterns (its configuration, not the body)
    # (Anthropic's errors carry no param: the field leads its message)
    "mcp url": re.compile(r"^(mcp_servers\[\d+\]\.url: )?MCP server URL .* is not allowed on this server; "
                          r"(none are allowed|allowed: )"),
    # a priority other than 0 on a server started without --scheduling-policy priority (its state)
    "priority off": re.compile(r"^priority -?\d+ needs the priority scheduling policy \(serve --scheduling-policy "
                               r"priority\); this server schedules \w+$"),
    # the server's own speculation exists only when it was started with it (its state, not the body)
    "speculation off": re.compile(r"^this server runs without speculative decoding in its steps"),
}


def semantic_reason(message: str) -> str | None:
    """The `SEMANTIC` rule a 400 message belongs to, or None."""
    for name, pattern in SEMANTIC.items():
        m = pattern.search(message)
        if m is None:
            continue
        if name == "context":
            prompt, max_tokens, total, context = map(int, m.groups())
            if prompt + max_tokens != total or total <= context:
                return None  # the numbers must show the overflow
        if name == "trace cap" and int(m.group(1)) <= int(m.group(2)):
            return None
        return name
    return None
