"""`RequestOptions`: how one request runs, beside its prompt and its `SamplingParams`. Frozen
and keyword-only; `LLM`, the async engine and the server build one and pass it unchanged to
`LLMEngine.add_request`, so a new per-request option is one field here and one use in the
engine, not an edit of every signature on the way."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class RequestOptions:
    """prompt_text: the prompt's text when the prompt is given as ids (outputs carry it);
    truncate_prompt: keep the prompt's last tokens that fit the context instead of refusing it;
    tracer: a `nextoken.trace.Tracer` recording every stage (the request runs in a pass of its
    own, on the reference attention, without the prefix cache or speculation);
    keep_prompt_hidden: with ``prompt_logprobs``, keep each scored prompt position's final
    hidden state (``RequestGroup.prompt_hidden``, ``[n - 1, hidden]``);
    first_tokens: ``(tokens, draws)``, first tokens drawn before the engine ran (the quick
    start's), emitted in place of the first draws, and the numbers of the seeded stream they
    used; return_logits: outputs carry completion 0's raw logits (`RequestOutput.logits`);
    lora_request: the `lora.LoRARequest` whose adapter the request runs with (None: the base);
    priority: its scheduling priority, lower first (vLLM's; any integer other than 0 needs the
    ``priority`` scheduling policy); client: who sent it (the ``fair`` policy shares service
    between clients); continuation: it continues a request that already held a place (a beam
    search's next step) and keeps that place in the waiting queue (`engine.request_queue`);
    final_only: the engine makes no output for it until it finishes (vLLM's
    ``RequestOutputKind.FINAL_ONLY``; `LLM.generate`'s requests and the server's requests that
    are not streamed, whose callers read only the final outputs: a snapshot per request per step
    is a cost of every step); detokenize: the
    engine makes its outputs' text (False: the front end that sent it does, from the token ids,
    `engine.core.OutputMirror`, as vLLM's front ends do; the engine then spends no time on text.
    Taken only for a request without stop strings, whose text the engine needs to stop it);
    cache_salt: salts its prefix-cache keys (vLLM's): its blocks serve, and are served by, only
    requests of the same salt, so that a tenant cannot learn from the cache's hits what another
    tenant's prompts hold (None: the shared cache)."""

    prompt_text: str | None = None
    truncate_prompt: bool = False
    tracer: Any = None
    keep_prompt_hidden: bool = False
    first_tokens: tuple[tuple[int, ...], int] | None = None
    return_logits: bool = False
    lora_request: Any = None
    priority: int = 0
    client: str = ""
    continuation: bool = False
    final_only: bool = False
    detokenize: bool = True
    cache_salt: str | None = None


DEFAULT = RequestOptions()
