"""What several commands share: the engine, sampling and prompt flags, and reading them back."""

from __future__ import annotations

import argparse
import sys

LOG_LEVELS = ("debug", "info", "warning", "error")
SAMPLING_EXCLUDED = ("seed",)  # the engine's flags a command with the request's flags leaves out


def _add_engine_args(p: argparse.ArgumentParser, log_level: str = "warning", **defaults) -> None:
    """The engine's flags (`EngineArgs`: one definition for every command) and --log-level."""
    from nextoken.engine_args import EngineArgs

    EngineArgs.add_cli_args(p, **defaults)
    p.add_argument("--log-level", choices=LOG_LEVELS, default=log_level,
                   help=f"log messages from this level up; info shows the execution plan (default {log_level})")


def _add_sampling_args(p: argparse.ArgumentParser, temperature: float, max_tokens: int) -> None:
    """The request's flags; its --seed is the request's (the engine's flags added with
    ``exclude=SAMPLING_EXCLUDED``)."""
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help=f"most tokens to generate (default {max_tokens})")
    g.add_argument("--temperature", "-t", type=float, default=temperature,
                   help=f"0 = greedy (default {temperature})")
    g.add_argument("--top-p", type=float, default=0.9 if temperature else 1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (-1: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="keep tokens with p >= min_p * p_max")
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None, dest="request_seed", help="same seed, same text")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-generation tokens")
    g.add_argument("--logprobs", type=int, default=None, help="print the N most likely tokens per step")
    g = p.add_argument_group("structured output")
    g.add_argument("--json-schema", metavar="FILE", default=None,
                   help="the output follows this JSON schema (a file; '-' reads standard input)")
    g.add_argument("--regex", default=None, help="the output matches this regular expression")
    g.add_argument("--watermark", action="store_true",
                   help="watermark the output (green-list, see `nextoken watermark detect`)")


def _add_prompt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--raw", action="store_true", help="plain completion: do not apply the chat template")
    p.add_argument("--system", default=None, help="system message for chat-formatted prompts")
    p.add_argument("--truncate-prompt", action="store_true",
                   help="drop the oldest prompt tokens when prompt + max tokens exceed the context")


def _add_serve_args(p, exclude: tuple[str, ...] = ()) -> None:
    """The server's flags (`serve`, `inspect`): the engine's and `ServerArgs`'."""
    from nextoken.server.args import ServerArgs

    _add_engine_args(p, log_level="info")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as --model (vLLM's `vllm serve MODEL`)")
    ServerArgs.add_cli_args(p, exclude=exclude)


def take_model_tag(parser: argparse.ArgumentParser, args) -> None:
    """A model given as the positional MODEL (`serve`, `inspect`) becomes ``args.model``; with a
    different --model too, the parser's one-line error (exit status 2)."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    from nextoken.catalog import DEFAULT_MODEL

    if args.model not in (DEFAULT_MODEL, tag):
        parser.error(f"the model is given twice: {tag!r} and --model {args.model!r}; give one")
    args.model = tag


def _params(a):
    """The command's `SamplingParams`, checked before any model loads (a bad value: one line at
    once, not after PyTorch's import; the vocabulary's bounds are checked when the model is read)."""
    from nextoken.sampling_params import SamplingParams

    return SamplingParams(
        temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
        repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
        frequency_penalty=a.frequency_penalty, seed=a.request_seed, max_tokens=a.max_tokens, stop=a.stop,
        ignore_eos=a.ignore_eos, logprobs=a.logprobs, structured_outputs=_structured(a), watermark=a.watermark,
    ).validate()


def _structured(a):
    """`StructuredOutputsParams` from --json-schema / --regex, or None."""
    from nextoken.errors import InvalidRequest
    from nextoken.structured import StructuredOutputsParams

    if a.json_schema is not None and a.regex is not None:
        raise InvalidRequest("give --json-schema or --regex, not both", "json_schema")
    if a.regex is not None:
        return StructuredOutputsParams(regex=a.regex)
    if a.json_schema is None:
        return None
    try:
        text = sys.stdin.read() if a.json_schema == "-" else open(a.json_schema, encoding="utf-8").read()
    except OSError as exc:
        raise InvalidRequest(f"cannot read the JSON schema {a.json_schema}: {exc.strerror}", "json_schema") from None
    return StructuredOutputsParams(json=text)


def engine_args(a):
    """The `EngineArgs` of a command's parsed arguments."""
    from nextoken.engine_args import EngineArgs

    return EngineArgs.from_cli_args(a)


def _load(a, first=None):
    """The model for a single-user command (`run`, `chat`, `explain`); `first`: the quick start's
    first token, which the engine takes over (`LLM.from_engine_args`). The model is resolved
    first, so that an unknown name or a missing file is one line before PyTorch is imported."""
    from nextoken.catalog import resolve_model

    args = engine_args(a)
    resolve_model(args.model, auto_pull=args.auto_pull)
    from nextoken.llm import LLM

    return LLM.from_engine_args(args, first)


def _read_text(path: str) -> str:
    """A file's text (or standard input's, for "-") exactly as written: UTF-8, line endings
    kept (Python's text mode would turn "\r\n" into "\n", and the tokens with it)."""
    from nextoken.errors import InvalidRequest

    try:
        data = sys.stdin.buffer.read() if path == "-" else open(path, "rb").read()
        return data.decode("utf-8")
    except OSError as exc:
        raise InvalidRequest(f"cannot read {path}: {exc.strerror}", "file") from None
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"{path} is not UTF-8 text: {exc}", "file") from None
