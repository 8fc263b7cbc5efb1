"""What a request asks its output to follow: `StructuredOutputsParams` (vLLM's name and fields).

Exactly one of ``json`` (a JSON schema), ``json_object`` (any JSON object), ``regex``,
``choice`` (one of these strings) or ``grammar`` (a Lark grammar in llguidance's dialect, or a
GBNF grammar as llama.cpp writes them) is set. `grammar_source()` turns it into the text
llguidance compiles; the compiled matcher is cached by that text (`backend.GrammarCompiler`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from nextoken.errors import InvalidRequest

# JSON whitespace when the schema does not say: none but one space after "," and ":" (the way
# json.dumps writes), so a small model cannot loop on optional whitespace. Objects that list
# their properties admit no others unless the schema says so (`close_objects`), for the same
# reason: otherwise a small model invents keys until max_tokens.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | str | None = None
    """A JSON schema (dict, or its JSON text)."""
    json_object: bool = False
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
    regex: str | None = None
    """A regular expression (Rust ``regex`` syntax) the whole output matches."""
    choice: tuple[str, ...] | list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A Lark grammar (llguidance's dialect: ``start: ...``, ``%json {...}``, ``<[id]>`` for a
    token by id) or a GBNF grammar (``root ::= ...``)."""

    def kind(self) -> str:
        """Which one constraint is set; raises `InvalidRequest` when none or several are."""
        set_ = [k for k in KINDS if (getattr(self, k) not in (None, False))]
        if len(set_) != 1:
            raise InvalidRequest(f"structured_outputs takes exactly one of {', '.join(KINDS)}; "
                                 f"got {', '.join(set_) or 'none'}", "structured_outputs")
        return set_[0]

    def source(self) -> tuple[str, str]:
        """``(kind, text)``: the constraint as text, canonical enough to key a cache."""
        kind = self.kind()
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise InvalidRequest(f"the JSON schema is not valid JSON: {exc}", "json_schema") from None
            if not isinstance(value, (dict, bool)):
                raise InvalidRequest("the JSON schema must be an object", "json_schema")
            return kind, json.dumps(value)  # property order is kept: it is the order of the output
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
                raise InvalidRequest("guided_choice must be a non-empty list of non-empty strings", "guided_choice")
            return kind, json.dumps(list(value))
        if not isinstance(value, str) or not value:
            raise InvalidRequest(f"{kind} must be a non-empty string", f"guided_{kind}")
        return kind, value


def close_objects(schema):
    """`schema` with ``additionalProperties: false`` on every object schema that lists
    ``properties`` and says nothing about others (what OpenAI's strict mode requires anyway).
    Output valid under the result is valid under `schema`."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (close_objects(v) if k != "const" and k != "enum" and k != "default" else v) for k, v in schema.items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema \
            and "unevaluatedProperties" not in schema:
        out["additionalProperties"] = False
    return out


def grammar_source(kind: str, text: str) -> str:
    """llguidance's grammar text for ``(kind, text)`` from `StructuredOutputsParams.source`.
    Raises `InvalidRequest` when the text cannot even be read (bad JSON, a GBNF grammar that does
    not convert); deeper errors surface when the grammar is compiled."""
    import llguidance

    field = {"json": "json_schema", "regex": "guided_regex", "grammar": "guided_grammar"}.get(kind, kind)
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(close_objects(json.loads(text)),
                                                                 defaults=JSON_DEFAULTS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in json.loads(text)))
        return llguidance.grammar_from("grammar", text)
    except ValueError as exc:
        raise InvalidRequest(f"{field} is not valid: {exc}", field) from None
