"""The command line, one module per family of commands.

``nextoken run | chat | explain | serve | inspect | bench | pull | models | cache | embed |
perplexity | watermark``: `generate`, `serving`, `models`, `cache`, `evaluate`; `common` holds
the flags they share.

Every error a user can cause prints one line (``error: ...``) and exits with status 1 or 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from nextoken.cli.common import (SAMPLING_EXCLUDED, _add_engine_args, _add_prompt_args, _add_sampling_args, _add_serve_args,
                                 take_model_tag)
from nextoken.cli_args import positive_int
from nextoken.config import QUANTIZATIONS
from nextoken.errors import NextokenError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nextoken", description="LLM inference that shows its work.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    single_user = {"max_num_seqs": 1}  # one conversation: a KV cache for one full context by default
    # one answer: the weights stay mapped where loaded, since the huge pages' copy at load costs more than
    # the decode it speeds up saves on an answer of a few hundred tokens (docs/benchmarks.md, 2026-11-30)
    one_answer = {**single_user, "huge_pages": False}

    p = sub.add_parser("run", help="answer one prompt, streaming the text")
    p.add_argument("prompt")
    _add_engine_args(p, exclude=SAMPLING_EXCLUDED, **one_answer)
    _add_prompt_args(p)
    _add_sampling_args(p, temperature=0.2, max_tokens=512)
    p.add_argument("--stats", action="store_true", help="print TTFT, prefill and decode speed, peak memory")
    p.add_argument("--no-quick-start", dest="quick_start", action="store_false",
                   help="let the engine draw the first token too, instead of drawing it before PyTorch is imported "
                        "(the same text as the API and the server give for a seed)")

    p = sub.add_parser("chat", help="interactive multi-turn chat (/reset, /exit)")
    _add_engine_args(p, exclude=SAMPLING_EXCLUDED, **single_user)
    p.add_argument("--system", default=None, help="system message")
    _add_sampling_args(p, temperature=0.2, max_tokens=512)

    p = sub.add_parser("explain", help="walk one prompt through the pipeline and print every stage")
    p.add_argument("prompt")
    _add_engine_args(p, exclude=SAMPLING_EXCLUDED, **one_answer)
    _add_prompt_args(p)
    _add_sampling_args(p, temperature=0.0, max_tokens=8)
    p.add_argument("--top", type=int, default=10, help="candidates shown per generated token")
    p.add_argument("--json", action="store_true", help="print the report as JSON")

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (and the inspector at /inspect)")
    _add_serve_args(p)

    p = sub.add_parser("inspect", help="start the server and print the inspector's URL (every stage, live, in a browser)")
    _add_serve_args(p, exclude=("inspect", "replicas", "router_policy"))

    p = sub.add_parser("run-batch", help="answer a file of OpenAI batch requests offline (vLLM's run-batch)")
    p.add_argument("-i", "--input-file", required=True, metavar="FILE",
                   help="JSON lines {custom_id, method, url, body} (OpenAI's batch input; - for standard input)")
    p.add_argument("-o", "--output-file", required=True, metavar="FILE",
                   help="where the answers go, one JSON line each in the input's order (- for standard output)")
    p.add_argument("--served-model-name", nargs="+", default=[], metavar="NAME",
                   help="the model names the requests may give (default: --model)")
    _add_engine_args(p, max_num_seqs=64)

    p = sub.add_parser("pull", help="download a catalog model and verify its SHA-256")
    p.add_argument("name")
    p.add_argument("--force", action="store_true", help="download again even if cached")

    sub.add_parser("models", help="list the catalog and what is cached")
    p = sub.add_parser("embed", help="embed texts with an embedding model and compare them (cosine similarity)")
    p.add_argument("texts", nargs="+", metavar="TEXT")
    p.add_argument("--model", "-m", default="all-minilm-l6-v2", help="an embedding model (default all-minilm-l6-v2)")
    p.add_argument("--dimensions", type=positive_int, default=None, help="cut the vectors (Matryoshka models only)")
    p.add_argument("--truncate", action="store_true", help="cut texts longer than the model takes")
    p.add_argument("--json", action="store_true", help="print the vectors as JSON (OpenAI's shape)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the encoder's dtype (auto: bfloat16 where the CPU multiplies it in hardware, else float32)")
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="quantize the encoder's linears at load (q8_0: its int8 GEMM)")

    from nextoken.cli.cache import add_parser as add_cache_parser

    add_cache_parser(sub)

    p = sub.add_parser("perplexity", help="perplexity of a text file, as llama.cpp's llama-perplexity computes it")
    p.add_argument("file", help="text file, or - for standard input")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk; the second half of each is scored (default 512)")
    p.add_argument("--max-chunks", type=positive_int, default=None, metavar="N", help="score at most N chunks")
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


def _version() -> str:
    from nextoken import __version__

    return f"nextoken {__version__}"


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
    parser = build_parser()
    args = parser.parse_args(argv)
    take_model_tag(parser, args)
    args.argv = argv
    if hasattr(args, "log_level"):
        _configure_logging(args.log_level)
    try:
        _prefetch_model_key(args)
        return _commands()[args.command](args)
    except NextokenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `nextoken explain ... | head`
        sys.stderr.close()
        return 0


def _commands() -> dict:
    from nextoken.cli import cache, evaluate, generate, models, serving

    return {"perplexity": evaluate.cmd_perplexity, "watermark": evaluate.cmd_watermark, "bench": models.cmd_bench,
            "serve": serving.cmd_serve, "inspect": serving.cmd_inspect, "run-batch": serving.cmd_run_batch,
            "run": generate.cmd_run,
            "chat": generate.cmd_chat, "explain": generate.cmd_explain, "pull": models.cmd_pull,
            "models": models.cmd_models, "cache": cache.cmd_cache, "embed": models.cmd_embed}

