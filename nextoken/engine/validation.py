"""A request's checks before it is queued: its prompt as token ids fitted to the context
window, and whether it can ever fit in the KV cache. Each failure is an `InvalidRequest` that
names the field and the numbers."""

from __future__ import annotations

from nextoken.errors import InvalidRequest, ModelLoadError
from nextoken.sampling_params import SamplingParams


def encode_prompt(tokenizer, vocab_size: int, max_model_len: int, prompt: str | list[int], params: SamplingParams,
                  truncate: bool = False) -> list[int]:
    """Token ids of `prompt` (text, or ids already), fitted to the context window.

    Raises `InvalidRequest` when the prompt is empty, holds ids outside the vocabulary, or when
    prompt tokens plus max_tokens exceed `max_model_len` (naming both numbers) and `truncate` is
    False; with `truncate` the oldest prompt tokens are dropped instead. The params'
    `truncate_prompt_tokens` keeps the last k tokens first."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(issubclass(k, int) and k is not bool for k in set(map(type, prompt))):
        # (the ids' types and bounds in C's loops: a 1024-token prompt's checks took 1.3 ms id by id)
        if prompt and (min(prompt) < 0 or max(prompt) >= vocab_size):
            bad = next(t for t in prompt if not 0 <= t < vocab_size)
            raise InvalidRequest(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})", "prompt")
        ids = list(prompt)
    else:
        raise InvalidRequest("prompt must be a string or a list of token ids", "prompt")
    if not ids:
        raise InvalidRequest("prompt is empty", "prompt")
    ids = kept_prompt(ids, params.truncate_prompt_tokens, max_model_len)
    ctx = max_model_len
    if len(ids) + params.max_tokens > ctx:
        if not truncate or params.max_tokens >= ctx:
            raise InvalidRequest(
                f"prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}: "
                f"{len(ids) + params.max_tokens} > the context length {ctx} (max_model_len); shorten the "
                "prompt, lower max_tokens, or truncate the prompt (truncate_prompt)", "max_tokens")
        ids = ids[len(ids) + params.max_tokens - ctx :]
    return ids


def kept_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """The prompt tokens `truncate_prompt_tokens` = `keep` leaves: the last `keep`, the last
    `max_model_len` for -1, all for None."""
    return ids if keep is None else ids[-(max_model_len if keep == -1 else keep):]


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """The token id sequences of `words` (`SamplingParams.bad_words`), vLLM's rule: each word as
    it reads alone (leading spaces dropped), and after a space where that is another first token
    but as many tokens (a word mid-sentence); no BOS."""
    out: list[list[int]] = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_bos=False, parse_special=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_bos=False, parse_special=False)
        for ids in (alone, spaced):
            if ids and ids not in out and (ids is alone or (ids[0] != alone[0] and len(ids) == len(alone))):
                out.append(ids)
    return out


def check_request(kv, num_prompt: int, params: SamplingParams, traced: bool, tensor_parallel: bool) -> None:
    """Raises `InvalidRequest` when the request could never fit in the KV cache manager `kv`
    (its prompt plus max_tokens), or when a traced request asks for n > 1 or runs under tensor
    parallelism."""
    needed = kv.blocks_for(num_prompt + params.max_tokens)
    if needed > kv.pool.num_blocks:
        raise InvalidRequest(
            f"the request needs {needed} KV cache blocks ({num_prompt} prompt + {params.max_tokens} new "
            f"tokens) but the cache holds {kv.pool.num_blocks}; raise the KV cache memory or lower max_tokens",
            "max_tokens")
    if traced and params.n != 1:
        raise InvalidRequest("a traced request takes n=1", "n")
    if traced and tensor_parallel:
        raise InvalidRequest("tracing a request is not available with tensor parallelism", "trace")


def check_priority(priority, policy: str) -> None:
    """Raises `InvalidRequest` (field ``priority``) for a priority that is not an integer, or one
    other than 0 when the scheduling policy is not ``priority`` (as vLLM refuses it)."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequest(f"priority must be an integer, got {priority!r}", "priority")
    if priority != 0 and policy != "priority":
        raise InvalidRequest(f"priority {priority} needs the priority scheduling policy (serve "
                             f"--scheduling-policy priority); this server schedules {policy}", "priority")


def resolve_lora(loras, lora_request) -> int:
    """The adapter id of `lora_request` (a `lora.LoRARequest`, loaded on first use into
    `loras`, the runner's `LoRAManager`), 0 for None. Raises `InvalidRequest` (field ``lora``)
    when LoRA is off or the adapter cannot be loaded."""
    if lora_request is None:
        return 0
    if loras is None:
        raise InvalidRequest("this engine serves no LoRA adapters; start it with enable_lora=True (--enable-lora)",
                             "lora")
    return loras.add(lora_request)


def read_template(path: str) -> str:
    """The text of a chat template file (`--chat-template`); `ModelLoadError` when unreadable."""
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except OSError as exc:
        raise ModelLoadError(f"cannot read the chat template {path}: {exc.strerror}") from None
