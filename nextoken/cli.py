"""Command line: ``nextoken run | chat | explain | serve | inspect | bench | pull | models``.

Every error a user can cause prints one line (``error: ...``) and exits with status 1 or 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import sys
import time

from nextoken.errors import NextokenError


LOG_LEVELS = ("debug", "info", "warning", "error")


def _add_engine_args(p: argparse.ArgumentParser, log_level: str = "warning", **defaults) -> None:
    """The engine's flags (`EngineArgs`: one definition for every command) and --log-level."""
    from nextoken.engine_args import EngineArgs

    EngineArgs.add_cli_args(p, **defaults)
    p.add_argument("--log-level", choices=LOG_LEVELS, default=log_level,
                   help=f"log messages from this level up; info shows the execution plan (default {log_level})")


def _add_sampling_args(p: argparse.ArgumentParser, temperature: float, max_tokens: int) -> None:
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
    g.add_argument("--seed", type=int, default=None, help="same seed, same text")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nextoken", description="LLM inference that shows its work.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    single_user = {"max_num_seqs": 1}  # one conversation: a KV cache for one full context by default

    p = sub.add_parser("run", help="answer one prompt, streaming the text")
    p.add_argument("prompt")
    _add_engine_args(p, **single_user)
    _add_prompt_args(p)
    _add_sampling_args(p, temperature=0.2, max_tokens=512)
    p.add_argument("--stats", action="store_true", help="print TTFT, prefill and decode speed, peak memory")
    p.add_argument("--no-quick-start", dest="quick_start", action="store_false",
                   help="let the engine draw the first token too, instead of drawing it before PyTorch is imported "
                        "(the same text as the API and the server give for a seed)")

    p = sub.add_parser("chat", help="interactive multi-turn chat (/reset, /exit)")
    _add_engine_args(p, **single_user)
    p.add_argument("--system", default=None, help="system message")
    _add_sampling_args(p, temperature=0.2, max_tokens=512)

    p = sub.add_parser("explain", help="walk one prompt through the pipeline and print every stage")
    p.add_argument("prompt")
    _add_engine_args(p, **single_user)
    _add_prompt_args(p)
    _add_sampling_args(p, temperature=0.0, max_tokens=8)
    p.add_argument("--top", type=int, default=10, help="candidates shown per generated token")
    p.add_argument("--json", action="store_true", help="print the report as JSON")

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (and the inspector at /inspect)")
    _add_serve_args(p)

    p = sub.add_parser("inspect", help="start the server and print the inspector's URL (every stage, live, in a browser)")
    _add_serve_args(p, exclude=("inspect", "replicas", "router_policy"))

    p = sub.add_parser("pull", help="download a catalog model and verify its SHA-256")
    p.add_argument("name")
    p.add_argument("--force", action="store_true", help="download again even if cached")

    sub.add_parser("models", help="list the catalog and what is cached")

    p = sub.add_parser("perplexity", help="perplexity of a text file, as llama.cpp's llama-perplexity computes it")
    p.add_argument("file", help="text file, or - for standard input")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk; the second half of each is scored (default 512)")
    p.add_argument("--max-chunks", type=_positive_int, default=None, metavar="N", help="score at most N chunks")
    p.add_argument("--kl-divergence", action="store_true",
                   help="also run the float32 reference path and print the KL divergence and top-1 agreement of "
                        "this configuration against it")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    _add_engine_args(p, max_num_seqs=8)

    p = sub.add_parser("watermark", help="score text for nextoken's (TGI's) green-list watermark")
    wsub = p.add_subparsers(dest="watermark_command", required=True)
    p = wsub.add_parser("detect", help="print tokens scored, green fraction and z-score of a text")
    p.add_argument("file", help="text file, or - for standard input")
    from nextoken.engine_args import EngineArgs

    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    p.add_argument("--model", "-m", default=defaults["model"], help="the model whose tokenizer wrote the text")
    p.add_argument("--watermark-gamma", type=float, default=defaults["watermark_gamma"],
                   help=f"the generating server's gamma (default {defaults['watermark_gamma']})")
    p.add_argument("--z-threshold", type=float, default=4.0, help="z above which the text counts as watermarked")
    p.add_argument("--json", action="store_true", help="print the result as JSON")

    p = sub.add_parser("bench", help="prefill, decode, batched throughput and peak memory (optionally vs llama.cpp)")
    from nextoken.bench import BENCH_ENGINE_DEFAULTS, BENCH_EXCLUDED, add_arguments

    _add_engine_args(p, exclude=BENCH_EXCLUDED, **BENCH_ENGINE_DEFAULTS)
    add_arguments(p)
    return parser


def _add_serve_args(p, exclude: tuple[str, ...] = ()) -> None:
    """The server's flags (`serve`, `inspect`): the engine's and `ServerArgs`'."""
    from nextoken.server.args import ServerArgs

    _add_engine_args(p, log_level="info")
    ServerArgs.add_cli_args(p, exclude=exclude)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _version() -> str:
    from nextoken import __version__

    return f"nextoken {__version__}"


def _params(a):
    from nextoken.sampling_params import SamplingParams

    return SamplingParams(
        temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
        repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
        frequency_penalty=a.frequency_penalty, seed=a.seed, max_tokens=a.max_tokens, stop=a.stop,
        ignore_eos=a.ignore_eos, logprobs=a.logprobs, structured_outputs=_structured(a), watermark=a.watermark,
    )


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
    first token, which the engine takes over (`LLM.from_engine_args`)."""
    from nextoken.llm import LLM

    return LLM.from_engine_args(engine_args(a), first)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _quick_first_token(a, params):
    """The first token before PyTorch is imported (`runner.quick_start`), printed at once; None
    when that path does not apply (then the engine does everything)."""
    if not a.quick_start or a.stats or a.logprobs is not None:  # --stats, --logprobs: the engine's view of every token
        return None
    from nextoken.runner.quick_start import first_token

    first = first_token(a.prompt, engine_args(a), params, chat=not a.raw, system=a.system)
    if first is not None:
        sys.stdout.write(first.text)
        sys.stdout.flush()
    return first


def cmd_run(a) -> int:
    params = _params(a)  # once: --json-schema - reads standard input
    first = _quick_first_token(a, params)
    if first is not None and first.finished:
        sys.stdout.write("\n")
        return 0
    llm = _load(a, first)
    params = params.validate(llm.config.vocab_size)
    chat = not a.raw and llm.tokenizer.chat_template is not None
    out = None
    printed = len(first.text) if first is not None else 0  # the quick token's text, printed already
    for out in llm.stream(a.prompt, params, chat=chat, system=a.system, truncate_prompt=a.truncate_prompt,
                          first=first):  # with `first`: the engine emits that token first, then goes on
        c = out.outputs[0]
        delta = c.delta[printed:]
        printed = max(0, printed - len(c.delta))
        sys.stdout.write(delta)
        sys.stdout.flush()
        if a.logprobs is not None and c.logprobs:
            top = ", ".join(f"{llm.tokenizer.token_text(t)!r}:{lp:.3f}" for t, lp in c.logprobs[-1].items())
            sys.stderr.write(f"  [{top}]\n")
    sys.stdout.write("\n")
    if a.stats:
        m = out.metrics
        n_out = len(out.outputs[0].token_ids)
        dec = f"{m.decode_tokens_per_s:.1f} tok/s ({m.tpot * 1000:.1f} ms/token)" if m.tpot else "n/a"
        sys.stderr.write(
            f"[stats] model {a.model} ({str(llm.runner.dtype).removeprefix('torch.')}) | prompt tokens {m.num_prompt_tokens} | output tokens {n_out} "
            f"({out.outputs[0].finish_reason}) | TTFT {m.ttft:.3f} s | prefill {m.prefill_tokens_per_s:.1f} tok/s | "
            f"decode {dec} | peak memory {_peak_rss_mib():.0f} MiB (weights {llm.runner.weight_bytes / 2**20:.0f} MiB, "
            f"KV cache {llm.runner.kv.nbytes / 2**20:.0f} MiB) | load {llm.runner.load_time:.2f} s{_spec_stats(llm)}\n")
    return 0


def _spec_stats(llm) -> str:
    st = llm.engine.stats()
    if llm.engine.speculative is None:
        return ""
    return (f" | speculative: {st['spec_num_accepted_tokens']}/{st['spec_num_drafted_tokens']} drafted tokens "
            f"accepted ({st['spec_acceptance_rate']:.0%}), {st['spec_mean_accepted_length']:.2f} tokens per step")


def cmd_chat(a) -> int:
    llm = _load(a)
    params = _params(a).validate(llm.config.vocab_size)
    messages: list[dict] = []
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"nextoken chat with {a.model}: /reset clears the conversation, /exit or Ctrl-D quits.")
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            messages = []
            continue
        messages.append({"role": "user", "content": line})
        reply = ""
        try:
            for out in llm.stream(messages, params, chat=True, system=a.system):
                delta = out.outputs[0].delta
                reply += delta
                sys.stdout.write(delta)
                sys.stdout.flush()
        except NextokenError as e:  # e.g. the conversation outgrew the context: say so, keep going
            messages.pop()
            print(f"error: {e}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_explain(a) -> int:
    from nextoken.trace.explain import explain_report, format_report, recorder_for

    llm = _load(a)
    params = _params(a).validate(llm.config.vocab_size)
    params.logprobs = None
    chat = not a.raw and llm.tokenizer.chat_template is not None
    tracer = recorder_for(llm.config)
    t0 = time.perf_counter()
    out = None
    for out in llm.stream(a.prompt, params, chat=chat, system=a.system, truncate_prompt=a.truncate_prompt,
                          tracer=tracer):
        pass
    total = time.perf_counter() - t0
    rendered = llm.render_chat([{"role": "user", "content": a.prompt}], a.system) if chat else None
    report = explain_report(tracer, llm.tokenizer, llm.config, a.top)
    report.update(prompt=a.prompt, rendered_prompt=rendered, output_text=out.outputs[0].text,
                  finish_reason=out.outputs[0].finish_reason, total_seconds=total,
                  model={"name": a.model, "architecture": llm.config.architecture, "layers": llm.config.num_layers,
                         "hidden_size": llm.config.hidden_size,
                         "dtype": str(llm.runner.dtype).removeprefix("torch.")})
    if a.json:
        print(json.dumps(report, indent=1, ensure_ascii=False))
    else:
        print(format_report(report, a.prompt, rendered, llm.config, params, total))
        print(f"\n== Output ({out.outputs[0].finish_reason}) ==\n{out.outputs[0].text}")
    return 0


def _server_args(a):
    from nextoken.server.args import ServerArgs

    return ServerArgs.from_cli_args(a)


def cmd_serve(a) -> int:
    if a.replicas:
        from nextoken.server.replicas import serve_replicas

        return serve_replicas(a, a.argv[a.argv.index("serve") + 1:])
    from nextoken.server.serve import serve

    return serve(engine_args(a), _server_args(a))


def cmd_inspect(a) -> int:
    from nextoken.server.serve import serve

    return serve(engine_args(a), _server_args(a), announce_inspector=True)


def cmd_pull(a) -> int:
    from nextoken.catalog import pull

    path = pull(a.name, force=a.force)
    print(path)
    return 0


def cmd_models(a) -> int:
    from nextoken.catalog import cache_dir, list_models

    print(f"{'NAME':<30} {'ARCH':<7} {'SIZE':>9}  {'CACHED':<6} DESCRIPTION")
    for m in list_models():
        print(f"{m['name']:<30} {m['architecture']:<7} {m['size'] / 2**20:>7.1f}Mi  {'yes' if m['cached'] else 'no':<6} "
              f"{m['description']}")
    print(f"cache: {cache_dir()}")
    return 0


def cmd_bench(a) -> int:
    from nextoken.bench import run

    return run(a, engine_args(a))


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


def cmd_perplexity(a) -> int:
    """`nextoken perplexity FILE|-`: llama-perplexity's method (`nextoken.evaluate.perplexity`)."""
    from nextoken.engine.engine import LLMEngine
    from nextoken.evaluate.perplexity import perplexity

    text = _read_text(a.file)
    args = engine_args(a)
    engine = LLMEngine.from_engine_args(args)
    reference = None
    if a.kl_divergence:
        reference = LLMEngine.from_engine_args(args.replace(
            dtype="float32", enforce_eager=True, reference_attention=True, speculative_model=None,
            speculative_method=None))
    res = perplexity(engine, text, a.ctx, reference, a.max_chunks, progress=not a.json)
    if a.json:
        out = dataclasses.asdict(res)
        out.pop("nll")
        print(json.dumps(out))
        return 0
    print(f"{res.num_chunks} chunks of {a.ctx} tokens, {res.num_tokens_scored} tokens scored")
    print(f"Final estimate: PPL = {res.ppl:.4f} +/- {res.ppl_uncertainty:.5f}")
    if res.kl_mean is not None:
        print(f"Mean KLD vs the float32 reference: {res.kl_mean:.6f} +/- {res.kl_uncertainty:.6f}; "
              f"same top token: {100 * res.top1_agreement:.2f}%")
    return 0


def cmd_watermark(a) -> int:
    """`nextoken watermark detect FILE|-`: needs the model's tokenizer and vocabulary size only."""
    from nextoken.catalog import resolve_model
    from nextoken.errors import InvalidRequest
    from nextoken.loader.source import load_tokenizer, open_model
    from nextoken.runner.model_runner import read_config
    from nextoken.sample.watermark import WatermarkConfig, detect

    try:
        WatermarkConfig(gamma=a.watermark_gamma)
    except ValueError as exc:
        raise InvalidRequest(str(exc), "watermark_gamma") from None
    text = _read_text(a.file)
    source = open_model(resolve_model(a.model))
    ids = load_tokenizer(source).encode(text, add_bos=False, parse_special=False)
    res = detect(ids, read_config(source).vocab_size, a.watermark_gamma, a.z_threshold)
    if a.json:
        print(json.dumps(dataclasses.asdict(res)))
    else:
        print(f"tokens scored {res.num_tokens_scored}, green {res.num_green_tokens} "
              f"({res.green_fraction:.1%}, expected {a.watermark_gamma:.0%}), z = {res.z_score:.2f}: "
              f"{'watermarked' if res.watermarked else 'no watermark found'} (threshold z > {a.z_threshold})")
    return 0


COMMANDS = {"perplexity": cmd_perplexity, "watermark": cmd_watermark, "bench": cmd_bench, "serve": cmd_serve, "inspect": cmd_inspect, "run": cmd_run, "chat": cmd_chat, "explain": cmd_explain, "pull": cmd_pull, "models": cmd_models}


def _configure_logging(level: str) -> None:
    import logging

    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _prefetch_model_key(a) -> None:
    """Start hashing the model's GGUF file for the prepared-weights cache (`loader.prepared`) on
    a second thread, so that it runs while PyTorch is imported. Only a file already here: a
    catalog model still to be pulled is hashed when it is loaded."""
    model = getattr(a, "model", None)
    if (not isinstance(model, str) or not getattr(a, "prepared_cache", False) or a.command == "bench"
            or getattr(a, "replicas", None)):  # bench's and the replicas' own processes load the model
        return
    from nextoken.catalog import model_path
    from nextoken.loader.prepared import prefetch_file_key

    prefetch_file_key(model if model.endswith(".gguf") else model_path(model))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if hasattr(args, "log_level"):
        _configure_logging(args.log_level)
    try:
        _prefetch_model_key(args)
        return COMMANDS[args.command](args)
    except NextokenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `nextoken explain ... | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
