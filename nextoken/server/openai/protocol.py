"""Request bodies of the OpenAI-compatible API, as pydantic models.

Every model forbids fields it does not know, so a parameter we do not support is a 400 that
names it instead of being silently ignored, and validates strictly (``"stream": 0`` or
``"n": "2"`` is a 400, not coerced), so the server accepts exactly what its OpenAPI schema
allows. Ranges follow the OpenAI API reference; vLLM's extensions (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens) are accepted too.

Limits that depend on the loaded model are marked ``x-maximum`` in the JSON schema
(`nextoken.bodies.model_limit`); `nextoken.server.app.openapi` turns each into a ``maximum`` once
the model is loaded.
"""

from __future__ import annotations

from itertools import combinations
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from nextoken import sampling_defaults
from nextoken.bodies import BODY, SEED_LIMIT, UNION_TAG, Answer, Body, FiniteFloat, LogprobCount, MaxTokens, NonEmptyStr, TokenId, \
    Published, accept_published, only, unset_or
from nextoken.errors import InvalidRequest
from nextoken.sampling_params import SamplingParams
from nextoken.server.api import published
from nextoken.server.api.rules import Rule, all_of, any_of, check, forbid, given, non_empty, one_of_values, true
from nextoken.server.chat import rules as chat_rules
from nextoken.server.chat.rules import ChatFields
from nextoken.structured.params import StructuredOutputsParams

# -- the cross-field rules of completions and chat (`api.rules`; the chat rules: `chat.rules`) ------
# one output constraint at most (`_Sampling.structured`); response_format counts when it asks for JSON
JSON_FORMAT = {"required": ["response_format"],
               "properties": {"response_format": {"type": "object", "required": ["type"],
                                                  "properties": {"type": {"enum": ["json_object", "json_schema"]}}}}}
CONSTRAINTS = [given("guided_json"), given("guided_regex"), given("guided_choice"), given("guided_grammar"),
               given("structured_outputs"), JSON_FORMAT]
CONSTRAINED = any_of(*CONSTRAINTS)
FORCING_CHOICE = {"anyOf": [{"const": "required"}, {"type": "object"}]}  # OpenAI's tool_choice that forces a call


CONSTRAINT_NAMES = ["guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                    "response_format"]


def sampling_rules(chat: bool) -> list[Rule]:
    """The refused combinations of /v1/completions (`chat` False) or /v1/chat/completions (but
    the tool rules every chat API shares: `server.chat.rules`)."""
    beam = true("use_beam_search")
    named = list(zip(CONSTRAINT_NAMES, CONSTRAINTS))
    rules = [Rule(all_of(a, b), f"give one output constraint, not {x} and {y}", y)
             for (x, a), (y, b) in combinations(named, 2)]
    rules += [Rule(all_of(cond, beam), f"{name} cannot be combined with use_beam_search", name) for name, cond in named]
    rules += [Rule(all_of(CONSTRAINED, true("ignore_eos")), "structured output cannot be combined with ignore_eos "
                   "(the grammar ends the output with an end-of-generation token)", "ignore_eos"),
              Rule(all_of(beam, true("stream")), "use_beam_search cannot stream", "stream")]
    if chat:
        rules += [Rule(all_of(given("top_logprobs"), {"not": true("logprobs")}), "top_logprobs needs logprobs to be "
                       "true", "top_logprobs"),
                  Rule(all_of(beam, any_of(true("logprobs"), given("prompt_logprobs"))),
                       "use_beam_search does not return logprobs", "use_beam_search"),
                  Rule(all_of(true("stream"), given("prompt_logprobs")), "prompt_logprobs are not available with "
                       "stream (as vLLM: ask without streaming)", "prompt_logprobs"),
                  Rule(all_of(beam, non_empty("tools")), "tools cannot be combined with use_beam_search", "tools")]
    else:
        score_only = {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}}
        rules += [Rule(all_of(beam, any_of(given("logprobs"), true("echo"), given("prompt_logprobs"))),
                       "use_beam_search does not return logprobs or echo the prompt", "use_beam_search"),
                  Rule(all_of(score_only, {"not": true("echo")}), "max_tokens 0 scores the prompt without "
                       "generating and needs echo (with logprobs for the scores)", "max_tokens"),
                  Rule(all_of(score_only, {"required": ["n"], "properties": {"n": {"not": {"const": 1}}}}),
                       "max_tokens 0 scores the prompt once: n must be 1", "n")]
    return rules


# structured_outputs: exactly one kind (`StructuredOutputsParams.kind`)
STRUCTURED_ONE = {"oneOf": [given("json"), given("regex"), given("choice"), given("grammar"), true("json_object")]}
# response_format of type json_schema carries its schema
JSON_SCHEMA_NEEDS_SCHEMA = {"if": one_of_values("type", ["json_schema"]), "then": given("json_schema")}


def union_of(*members: tuple[str, type, str]) -> Any:
    """A body that is one of several models, chosen by which of their keys it has: each member
    is ``(tag, model, key)``; the last member is the default. The schema is their ``oneOf`` (the
    members exclude each other by their required keys and ``additionalProperties: false``)."""
    def pick(v):
        if isinstance(v, dict):
            for tag, _, key in members:
                if key in v:
                    return UNION_TAG + tag
        return UNION_TAG + members[-1][0]
    return Annotated[Union[tuple(Annotated[m, Tag(UNION_TAG + tag)] for tag, m, _ in members)], Discriminator(pick)]


class StreamOptions(Body):
    include_usage: bool = False


class JsonSchemaFormat(Body):
    model_config = ConfigDict(**BODY, populate_by_name=True)
    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    """OpenAI's ``response_format``: text, any JSON object, or a JSON schema."""

    model_config = ConfigDict(**BODY, json_schema_extra=JSON_SCHEMA_NEEDS_SCHEMA)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Body):
    """vLLM's ``structured_outputs``: exactly one of its fields."""

    model_config = ConfigDict(**BODY, json_schema_extra=STRUCTURED_ONE)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: NonEmptyStr | None = None
    choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    grammar: NonEmptyStr | None = None
    json_object: bool | None = None


# {token id: bias in [-100, 100]}; keys are decimal token ids (the schema's patternProperties
# with additionalProperties false say so)
LogitBias = Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]+$")], Annotated[FiniteFloat, Field(ge=-100, le=100)]],
                      Field(json_schema_extra={"additionalProperties": False})]


class _Sampling(Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=16)
    use_beam_search: bool = False  # beam search (vLLM's extension): best_of beams, the n best returned
    best_of: int | None = Field(None, ge=1, le=10)
    length_penalty: FiniteFloat = 1.0
    temperature: FiniteFloat = Field(1.0, ge=0.0, le=2.0)
    top_p: FiniteFloat = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: FiniteFloat = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: FiniteFloat = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: FiniteFloat = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: FiniteFloat = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: LogitBias | None = None
    # vLLM's token restrictions, left out of the published schema (chat's is at the limit of what
    # schemathesis can build cases for: `ChatCompletionRequest._router_fields`)
    allowed_token_ids: SkipJsonSchema[list[TokenId] | None] = None
    bad_words: SkipJsonSchema[list[NonEmptyStr] | None] = None
    truncate_prompt_tokens: SkipJsonSchema[int | None] = None  # (vLLM's: the last k prompt tokens; -1: the context)
    # vLLM's token ids in the answer (RL frameworks read them): the prompt's and each choice's ids, and
    # log-probabilities' tokens written "token_id:N"
    return_token_ids: SkipJsonSchema[bool | None] = None
    return_tokens_as_token_ids: SkipJsonSchema[bool | None] = None
    seed: int | None = Field(None, ge=-SEED_LIMIT, le=SEED_LIMIT)
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=16)] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int = 0  # vLLM's: lower goes first under serve --scheduling-policy priority
    cache_salt: NonEmptyStr | None = None  # vLLM's: prefix-cache blocks shared only with requests of the same salt
    # structured output: OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: NonEmptyStr | None = None
    guided_choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    guided_grammar: NonEmptyStr | None = None
    structured_outputs: StructuredOutputs | None = None
    watermark: bool = False  # TGI's green-list watermark (the server's --watermark-gamma/--watermark-delta)

    RULES: ClassVar[list] = []

    def check_rules(self) -> None:
        """Raise `InvalidRequest` for the first cross-field rule (`server.api.rules`) this body breaks."""
        check(self.model_dump(exclude_none=True, by_alias=True), self.RULES)

    def structured(self) -> StructuredOutputsParams | None:
        """The one output constraint this request asks for (`check_rules` refuses several), or
        None."""
        given = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise InvalidRequest("response_format of type json_schema needs json_schema", "response_format")
            given.append(("response_format", StructuredOutputsParams(json=rf.json_schema.json_schema)))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                given.append((name, StructuredOutputsParams(**{key: getattr(self, name)})))
        if self.structured_outputs is not None:
            so = self.structured_outputs
            given.append(("structured_outputs", StructuredOutputsParams(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                json_object=bool(so.json_object))))
        if not given:
            return None
        name, spec = given[0]
        try:
            spec.kind()
        except InvalidRequest as exc:
            raise InvalidRequest(str(exc), name) from None
        return spec

    def detokenize_options(self) -> dict:
        """`SamplingParams`' detokenization fields this body sets (none: their defaults)."""
        return {}

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        structured: StructuredOutputsParams | None = None,
                        prompt_logprobs: int | None = None, defaults: dict | None = None) -> SamplingParams:
        """The request's `SamplingParams`; `defaults`: the model's (`nextoken.sampling_defaults`),
        for the sampling fields the body leaves unset."""
        if max_tokens == 0 and prompt_logprobs is None:
            prompt_logprobs = 0  # echo without logprobs: nothing to generate, the prompt is computed once
        fields = self.sampling_fields(logprobs)
        fields.update({k: v for k, v in (defaults or {}).items() if k in sampling_defaults.unset(self.model_fields_set)})
        fields["min_tokens"] = min(fields["min_tokens"], max_tokens)
        return SamplingParams(**fields, max_tokens=max_tokens, structured_outputs=structured,
                              prompt_logprobs=prompt_logprobs)

    def sampling_fields(self, logprobs: int | None) -> dict:
        """The `SamplingParams` fields this body sets, but max_tokens, the output constraint and
        the prompt's log-probabilities (what the chat core's `ChatSpec.sampling` holds)."""
        return dict(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos, logprobs=logprobs,
            **self.detokenize_options(),
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens, watermark=self.watermark)


TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(_Sampling):
    RULES: ClassVar[list] = sampling_rules(chat=False)  # the table's cross-field rules: the schema below, and `check_rules`
    model_config = ConfigDict(**BODY, json_schema_extra=forbid(*RULES))

    prompt: Union[NonEmptyStr, Annotated[list[NonEmptyStr], Field(min_length=1)], TokenIds,
                  Annotated[list[TokenIds], Field(min_length=1)]]
    max_tokens: Annotated[MaxTokens, Field(ge=0)] | None = 16  # 0: score the prompt only (with echo)
    logprobs: LogprobCount | None = None
    echo: bool = False
    prompt_logprobs: LogprobCount | None = None  # vLLM's extension: choices[].prompt_logprobs
    # vLLM's detokenization options; no_stop_trim is SGLang's name for include_stop_str_in_output
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    no_stop_trim: bool = False
    return_hidden_states: only(False) = False  # routers send it with every request (false)

    def detokenize_options(self) -> dict:
        return {"skip_special_tokens": self.skip_special_tokens,
                "include_stop_str_in_output": self.include_stop_str_in_output or self.no_stop_trim}

    def generation_limit(self) -> int:
        """max_tokens (16 when not given; 0 with echo: `RULES`)."""
        return 16 if self.max_tokens is None else self.max_tokens

    def scored_prompt(self) -> int | None:
        """How many alternatives each prompt position's log-probabilities carry, when the
        prompt is scored: echo with logprobs, or prompt_logprobs; else None."""
        if self.prompt_logprobs is not None:
            return max(self.prompt_logprobs, self.logprobs or 0) if self.echo else self.prompt_logprobs
        return self.logprobs if self.echo and self.logprobs is not None else None


class FunctionCall(Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatTextPart(Body):
    """A text part of a message's content (OpenAI's ``{"type": "text", "text": ...}``)."""

    type: Literal["text"]
    text: str


MEDIA_PARTS = ("image_url", "input_audio", "file")  # content parts only a vision, audio or file model reads


class ChatMessage(Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ChatTextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _media_parts(cls, data):
        """An image, audio or file part (`MEDIA_PARTS`, valid OpenAI input) is refused by name:
        the models served here read text only. Not in the published schema."""
        content = data.get("content") if isinstance(data, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if isinstance(part, dict) and part.get("type") in MEDIA_PARTS:
                raise PydanticCustomError("unsupported_value", "content[{j}]: {kind} parts are not supported: this "
                                          "model reads text only; send text parts or a string",
                                          {"j": j, "kind": part["type"]})
        return data

    def text(self) -> str:
        """The message's text: its content, or its text parts joined by newlines (as
        `template_dict`); empty without content."""
        return self.template_dict().get("content") or ""

    def template_dict(self) -> dict:
        """This message as the chat template takes it: content given as text parts joined by
        newlines (as vLLM joins them)."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "\n".join(part.text for part in self.content)
        return out


class FunctionDefinition(Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


# What vllm-router (0.1.17) adds to every chat request, at these values. The reasoning switches
# (vLLM's include_reasoning, SGLang's separate_reasoning and stream_reasoning) change nothing
# at their defaults: nextoken has no reasoning parser, so there is no separate reasoning text.
# POST /v1/chat/completions (the `openai` SDK's CompletionCreateParams)
PUBLISHED_CHAT = {
    "store": Published("stored completions are OpenAI's distillation store: nothing is stored here"),
    "metadata": Published("labels for stored completions (nothing is stored)"),
    "prompt_cache_key": published.CACHE, "prompt_cache_retention": published.CACHE,
    "prompt_cache_options": published.CACHE,
    "safety_identifier": published.ACCOUNT, "moderation": published.ACCOUNT,
    "service_tier": published.TIER,
    "reasoning_effort": published.HINT, "verbosity": published.HINT,
    "prediction": Published("predicted outputs only speed a provider up; the output is the same"),
    "modalities": Published("text is the only output", unset_or(["text"]), "only [\"text\"] output is produced"),
    "audio": Published("audio output", published.empty_or_unset, "audio output is not produced"),
    "web_search_options": Published("web search", published.empty_or_unset, "web search is not available here"),
    "functions": Published("the deprecated form of tools", published.empty_or_unset, "send them as tools"),
    "function_call": Published("the deprecated form of tool_choice", unset_or("none", "auto"),
                               "send tool_choice instead"),
}

ROUTER_CHAT_FIELDS = {"no_stop_trim": False, "skip_special_tokens": True, "return_hidden_states": False,
                      "include_reasoning": True, "separate_reasoning": True, "stream_reasoning": True}


CHAT_FIELDS = ChatFields(FORCING_CHOICE, constraints=tuple(CONSTRAINTS))  # the chat rules in chat's names


class ChatCompletionRequest(_Sampling):
    RULES: ClassVar[list] = sampling_rules(chat=True)  # the table's cross-field rules: the schema below, and `check_rules`
    model_config = ConfigDict(**BODY, json_schema_extra=forbid(*RULES, *chat_rules.published(CHAT_FIELDS)))

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Annotated[MaxTokens, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[MaxTokens, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None
    prompt_logprobs: LogprobCount | None = None  # vLLM's extension: the answer's prompt_logprobs
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables, e.g. enable_thinking
    # vLLM's prefill switches: the answer continues the last (assistant) message. Left out of the
    # published schema, as the router's fields are (`_router_fields`)
    add_generation_prompt: SkipJsonSchema[bool] = True
    continue_final_message: SkipJsonSchema[bool] = False
    echo: SkipJsonSchema[bool] = False  # the answer starts with the last message's text when that is the assistant's
    chat_template: SkipJsonSchema[str | None] = None  # vLLM's: the request's own template (--trust-request-chat-template)

    @model_validator(mode="before")
    @classmethod
    def _router_fields(cls, data):
        """Drop the fields vllm-router adds to every chat request when they hold the values it
        sends (`ROUTER_CHAT_FIELDS`); any other value stays, and is refused as an unsupported
        parameter. Then OpenAI's published fields that change nothing here (`PUBLISHED_CHAT`). They are not in the published schema: one more property puts this body's
        cross-field rules past what schemathesis's generator can build cases for."""
        if isinstance(data, dict) and any(k in data for k in ROUTER_CHAT_FIELDS):
            data = {k: v for k, v in data.items() if not (k in ROUTER_CHAT_FIELDS and v is ROUTER_CHAT_FIELDS[k])}
        return accept_published(data, PUBLISHED_CHAT)

    def echoed(self) -> str:
        """With ``echo`` (vLLM's), the text an answer starts with: the last message's when it is
        the assistant's (the message the answer continues, `continue_final_message`), else empty."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""


class TokenizePromptRequest(Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the model's BOS, where it adds one


class TokenizeChatRequest(Body):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)  # rendered with the chat template and its generation prompt
    continue_final_message: only(False) = False  # vLLM's; routers send it (false)


TokenizeRequest = union_of(("chat", TokenizeChatRequest, "messages"), ("prompt", TokenizePromptRequest, "prompt"))


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[TokenId]


class WatermarkTokens(Body):
    """Token ids to score for the watermark (`nextoken.sample.watermark.detect`)."""

    model: str | None = None
    tokens: list[TokenId] = Field(min_length=2)
    z_threshold: FiniteFloat = 4.0


class WatermarkText(Body):
    """Text to score for the watermark, tokenized without special tokens."""

    model: str | None = None
    text: NonEmptyStr
    z_threshold: FiniteFloat = 4.0


WatermarkDetectRequest = union_of(("tokens", WatermarkTokens, "tokens"), ("text", WatermarkText, "text"))


class LoadLoRARequest(Body):
    """vLLM's ``POST /v1/load_lora_adapter`` body."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRARequest(Body):
    """vLLM's ``POST /v1/unload_lora_adapter`` body."""

    lora_name: str = Field(min_length=1)


# -- answers (the 200 bodies and stream chunks that `render` builds; the SDKs' shapes) -----------
class TopLogprob(Answer):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Answer):
    content: list[TokenLogprob] | None


class CompletionLogprobs(Answer):
    """The legacy completions' log-probabilities: per token its text, log-probability (None: a
    prompt's first token), top alternatives (text -> log-probability) and character offset."""
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptTokensDetails(Answer):
    cached_tokens: int


class UsageInfo(Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionChoice(Answer):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it
    prompt_logprobs: list[dict[str, dict[str, float]] | None] | None = None  # vLLM's, when asked
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids: the prompt's (a stream's first chunk)
    token_ids: list[int] | None = None  # and the choice's (a stream's chunk: its new ones), its stop token too


class Completion(Answer):
    """A ``text_completion``, and each chunk of its stream (a chunk's usage: the last, when asked)."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class FunctionCallAnswer(Answer):
    name: str
    arguments: str


class ToolCallAnswer(Answer):
    id: str
    type: Literal["function"]
    function: FunctionCallAnswer


class AssistantMessage(Answer):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None  # with a reasoning parser (vLLM's name; ``reasoning`` too)
    reasoning: str | None = None
    tool_calls: list[ToolCallAnswer] | None = None


class ChatChoice(Answer):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None  # vLLM's return_token_ids: the choice's, its stop token too


class ChatCompletion(Answer):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids: the rendered prompt's
    prompt_logprobs: list[dict[str, dict[str, float]] | None] | None = None  # vLLM's, when asked


class ChunkFunction(Answer):
    name: str | None = None
    arguments: str | None = None


class ChunkToolCall(Answer):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ChunkFunction


class ChatDelta(Answer):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ChunkToolCall] | None = None


class ChunkChoice(Answer):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids: this step's new ids


class ChatCompletionChunk(Answer):
    """One ``data:`` chunk of a streamed chat completion (usage: the last, with include_usage)."""
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids: on the first chunk


class StreamErrorBody(Answer):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class StreamError(Answer):
    """The chunk that ends a stream the engine could not finish (after the 200)."""
    error: StreamErrorBody


class TokenizeAnswer(Answer):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeAnswer(Answer):
    prompt: str


# -- the Responses API's answers (`responses_render` builds the items) ---------------------------
class OutputText(Answer):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[TokenLogprob] | None = None  # with include ["message.output_text.logprobs"]


class MessageOutput(Answer):
    type: Literal["message"]
    id: str
    status: str
    role: Literal["assistant"]
    content: list[OutputText]


class ReasoningText(Answer):
    type: Literal["reasoning_text"]
    text: str


class ReasoningOutput(Answer):
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    status: str
    content: list[ReasoningText]


class FunctionCallOutput(Answer):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


class MCPListedTool(Answer):
    name: str
    description: str
    input_schema: dict[str, Any]
    annotations: dict[str, Any] | None = None


class MCPListToolsOutput(Answer):
    type: Literal["mcp_list_tools"]
    id: str
    server_label: str
    tools: list[MCPListedTool]
    error: str | None = None


class MCPCallOutput(Answer):
    type: Literal["mcp_call"]
    id: str
    server_label: str
    name: str
    arguments: str
    output: str | None
    error: str | None
    status: str
    approval_request_id: str | None = None


class MCPApprovalRequestOutput(Answer):
    type: Literal["mcp_approval_request"]
    id: str
    server_label: str
    name: str
    arguments: str


OutputItem = Annotated[Union[MessageOutput, ReasoningOutput, FunctionCallOutput, MCPListToolsOutput, MCPCallOutput,
                             MCPApprovalRequestOutput], Field(discriminator="type")]


class InputTokensDetails(Answer):
    cached_tokens: int


class OutputTokensDetails(Answer):
    reasoning_tokens: int


class ResponseUsage(Answer):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class IncompleteDetails(Answer):
    reason: Literal["max_output_tokens"]


class ResponseObject(Answer):
    """A response (``POST /v1/responses``, ``GET /v1/responses/{id}``), and the ``response`` of
    the stream's created, in_progress, completed and incomplete events."""
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[OutputItem]
    output_text: str
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    metadata: dict[str, Any]
    error: Any = None
    usage: ResponseUsage


class ResponseDeleted(Answer):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


# -- the server's own routes' answers (`server.app.routes`: vLLM's and SGLang's shapes) ---------------
class HealthAnswer(Answer):
    status: Literal["ok"]


class ServerVersion(Answer):
    version: str


class ModelCard(Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    root: str
    parent: str | None


class ModelCardList(Answer):
    object: Literal["list"]
    data: list[ModelCard]


class LoadReport(Answer):
    load: int
    num_reqs: int
    num_waiting_reqs: int


class TokenizerInfo(Answer):
    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    add_bos_token: bool
    chat_template: str | None
    model_max_length: int
    vocab_size: int


class WatermarkDetection(Answer):
    num_tokens_scored: int
    num_green_tokens: int
    green_fraction: float
    z_score: float
    watermarked: bool
    gamma: float


# -- the Responses API's stream: one model per family of events (`responses_render.emit`) --------
class _Event(Answer):
    sequence_number: int


class ResponseLifecycleEvent(_Event):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete"]
    response: ResponseObject


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(_Event):
    type: Literal["response.output_text.delta", "response.reasoning_text.delta"]
    item_id: str
    output_index: int
    content_index: int
    delta: str


class TextDoneEvent(_Event):
    type: Literal["response.output_text.done", "response.reasoning_text.done"]
    item_id: str
    output_index: int
    content_index: int
    text: str


class ArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta", "response.mcp_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done", "response.mcp_call_arguments.done"]
    item_id: str
    output_index: int
    arguments: str


class ItemStatusEvent(_Event):
    type: Literal["response.mcp_call.in_progress", "response.mcp_call.completed", "response.mcp_call.failed",
                  "response.mcp_list_tools.in_progress", "response.mcp_list_tools.completed",
                  "response.mcp_list_tools.failed"]
    item_id: str
    output_index: int


class ErrorEvent(_Event):
    """The event that ends a stream that could not go on after the 200."""
    type: Literal["error"]
    message: str
    code: str
    param: str | None = None


ResponseStreamEvent = Annotated[Union[ResponseLifecycleEvent, OutputItemEvent, ContentPartEvent, TextDeltaEvent,
                                      TextDoneEvent, ArgumentsDeltaEvent, ArgumentsDoneEvent, ItemStatusEvent,
                                      ErrorEvent], Field(discriminator="type")]
