"""The command line end to end, as a user runs it (subprocesses)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from nextoken import LLM, SamplingParams
from tests.conftest import load_reference

pytestmark = pytest.mark.subprocess  # every test here starts processes of its own


def nextoken(*args, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "nextoken.cli", *map(str, args)], input=stdin,
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_run_real_model_greedy_chat_equals_reference(smollm2_path):
    ref = next(g for g in load_reference("smollm2-135m-instruct")["generations"]
               if g["prompt"] == [{"role": "user", "content": "What is the capital of France?"}])
    r = nextoken("run", "What is the capital of France?", "--model", smollm2_path, "--dtype", "float32",
                 "--temperature", "0", "--stats")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ref["greedy_text"].replace("<|im_end|>", "")
    for field in ("prompt tokens 37", "TTFT", "prefill", "decode", "peak memory"):
        assert field in r.stderr


def test_one_answer_commands_keep_the_weights_mapped_and_the_others_move_them():
    """`run` and `explain` answer once: the huge pages' copy at load would cost more than it saves
    (docs/benchmarks.md, 2026-11-30), so their default is off; the long-lived commands keep it."""
    from nextoken.cli import build_parser

    parser = build_parser()
    for argv, huge in ((["run", "hi"], False), (["explain", "hi"], False), (["chat"], True), (["serve"], True),
                       (["bench"], True), (["run", "hi", "--huge-pages"], True), (["serve", "--no-huge-pages"], False)):
        assert parser.parse_args(argv).huge_pages is huge, argv


def test_serve_takes_the_model_as_vllm_serve_does(capsys):
    """``nextoken serve MODEL`` (vLLM's ``vllm serve MODEL``) and ``inspect MODEL`` serve MODEL,
    as --model does; both at once with different models is a one-line error (status 2)."""
    import pytest

    from nextoken.catalog import DEFAULT_MODEL
    from nextoken.cli import build_parser
    from nextoken.cli.common import take_model_tag

    parser = build_parser()
    for argv, want in ((["serve", "gemma-3-270m"], "gemma-3-270m"), (["serve", "--model", "a.gguf"], "a.gguf"),
                       (["inspect", "/m/x.gguf", "--port", "9"], "/m/x.gguf"), (["serve"], DEFAULT_MODEL),
                       (["serve", "a.gguf", "--model", "a.gguf"], "a.gguf")):
        args = parser.parse_args(argv)
        take_model_tag(parser, args)
        assert args.model == want, argv
    args = parser.parse_args(["serve", "a.gguf", "-m", "b.gguf"])
    with pytest.raises(SystemExit) as exit_:
        take_model_tag(parser, args)
    assert exit_.value.code == 2 and "the model is given twice: 'a.gguf' and --model 'b.gguf'" in capsys.readouterr().err


def test_vllm_command_lines_and_keywords_are_taken(capsys, tiny_gguf):
    """What vLLM users type: ``--enable-prefix-caching`` / ``--no-enable-chunked-prefill``
    (vLLM's spellings of ours), ``--seed`` (the engine's, for the requests that set none),
    ``--uvicorn-log-level`` and ``--disable-uvicorn-access-log`` (uvicorn's), and
    ``--trust-remote-code``, ``--enable-auto-tool-choice --tool-call-parser hermes``,
    ``--disable-log-requests`` and ``--disable-log-stats`` (what nextoken does anyway), and
    ``LLM(..., trust_remote_code=True)``. A tool-call format nextoken does not parse is refused,
    naming the one it does."""
    import pytest

    from nextoken.cli import build_parser
    from nextoken.engine_args import EngineArgs
    from nextoken.server.args import ServerArgs

    parser = build_parser()
    ns = parser.parse_args(["serve", "m", "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
                            "--trust-remote-code", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                            "--seed", "3", "--disable-log-requests", "--disable-log-stats", "--uvicorn-log-level",
                            "info", "--disable-uvicorn-access-log"])
    engine = EngineArgs.from_cli_args(ns)
    assert not engine.enable_prefix_caching and not engine.enable_chunked_prefill and engine.trust_remote_code
    assert engine.seed == 3
    server = ServerArgs.from_cli_args(ns)
    assert server.tool_call_parser == "hermes" and server.disable_log_requests and server.disable_log_stats
    from nextoken.server.serve import uvicorn_config

    config = uvicorn_config(None, server)
    assert config.log_level == "info" and not config.access_log
    config = uvicorn_config(None, ServerArgs.from_cli_args(parser.parse_args(["serve"])))
    assert config.log_level == "warning" and config.access_log
    assert parser.parse_args(["serve", "--enable-prefix-caching"]).enable_prefix_caching
    assert parser.parse_args(["serve", "-tp", "2"]).tensor_parallel_size == 2
    again = EngineArgs.from_cli_args(parser.parse_args(["serve", *engine.to_cli_args()]))
    assert again == engine  # (our own spelling for a child process)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--tool-call-parser", "llama3_json"])
    assert "--tool-call-parser: invalid choice: 'llama3_json'" in capsys.readouterr().err
    llm = LLM(str(tiny_gguf["llama"][0]), trust_remote_code=True)
    assert llm.generate([3, 4, 5], SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids
    llm.close()


def test_run_raw_with_sampling_options(tiny_gguf):
    """Seeded sampling from the command prints what `LLM.generate` gives for the same values."""
    path = tiny_gguf["llama"][0]
    args = ["run", "the cat", "--model", path, "--raw", "--max-tokens", "6", "--temperature", "0.9",
            "--top-k", "20", "--top-p", "0.9", "--min-p", "0.01", "--seed", "3", "--repetition-penalty", "1.1"]
    a = nextoken(*args)
    assert a.returncode == 0, a.stderr
    params = SamplingParams(max_tokens=6, temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, seed=3,
                            repetition_penalty=1.1)
    assert a.stdout == LLM(str(path)).generate("the cat", params)[0].outputs[0].text + "\n"


def test_run_prints_each_tokens_logprobs(tiny_gguf):
    """``run --logprobs 2`` prints, per generated token on stderr, the token and its two
    alternatives with the log-probabilities `LLM.generate` gives (float32: the same numbers),
    every token's also when an output carries several (``--stream-interval 2``)."""
    path = tiny_gguf["llama"][0]
    r = nextoken("run", "the cat", "--model", path, "--raw", "--max-tokens", "5", "--temperature", "0",
                 "--ignore-eos", "--logprobs", "2", "--dtype", "float32", "--stream-interval", "2")
    assert r.returncode == 0, r.stderr
    llm = LLM(str(path), dtype="float32")
    c = llm.generate("the cat", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2))[0].outputs[0]
    want = ["  [" + ", ".join(f"{llm.tokenizer.token_text(t)!r}:{lp:.3f}" for t, lp in pos.items()) + "]"
            for pos in c.logprobs]
    assert [line for line in r.stderr.splitlines() if line.startswith("  [")] == want

def test_explain_json(tiny_gguf):
    r = nextoken("explain", "the cat sat", "--model", tiny_gguf["llama"][0], "--json", "--max-tokens", "3",
                 "--temperature", "0.7", "--top-k", "5", "--seed", "1", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["tokens"][0] == {"id": 1, "text": "<|im_start|>"}  # chat-formatted
    assert rep["rendered_prompt"].startswith("<|im_start|>user\nthe cat sat")
    assert len(rep["layers"]) == 2 and len(rep["steps"]) <= 3
    step = rep["steps"][0]
    assert sum(c["kept"] for c in step["candidates"]) == min(5, step["kept_count"])
    assert step["chosen"]["id"] in [c["id"] for c in step["candidates"] if c["kept"]]
    sizes = [k["bytes"] for k in rep["kv_cache"]]
    assert sizes == sorted(sizes) and sizes[0] == len(rep["tokens"]) * 2 * 2 * 2 * 16 * 4


def test_explain_text_shows_every_stage(smollm2_path):
    r = nextoken("explain", "What is gravity?", "--model", smollm2_path, "--max-tokens", "2")
    assert r.returncode == 0, r.stderr
    for section in ("1. Text", "2. Chat template", "3. Tokens", "4. Embedding", "5. Positions and RoPE",
                    "6. Transformer layers (30)", "7. Logits", "8. KV cache", "'Gra'"):
        assert section in r.stdout


def test_chat_keeps_the_conversation(smollm2_path, smollm2_llm):
    """The second turn sees the first (its answer changes); after /reset it is a fresh session,
    which answers as `LLM.stream` does for the same chat."""
    params = SamplingParams(max_tokens=16, temperature=0)
    question = [{"role": "user", "content": "What is 2+2?"}]
    fresh = "".join(o.outputs[0].delta for o in smollm2_llm.stream(question, params, chat=True)) + "\n"
    # one session: "Hello!" (its answer, unknown here), /reset, the fresh question, /reset, then
    # "Hello!" again and the question as its second turn
    r = nextoken("chat", "--model", smollm2_path, "--max-tokens", "16", "--temperature", "0",
                 stdin="Hello!\n/reset\nWhat is 2+2?\n/reset\nHello!\nWhat is 2+2?\n")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    first = out[: out.index(fresh)]  # the first answer (each reply ends in a newline)
    assert first and out.startswith(first + fresh + first)  # after /reset the same answers as fresh sessions
    assert out[len(first + fresh + first):] != fresh  # the second turn saw the first


@pytest.mark.parametrize("args,message", [
    (["run", "hi", "--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["run", "hi", "--model", "/nonexistent/x.gguf"], "not found"),
    (["run", "hi", "--temperature", "-1"], "temperature must be"),
    (["pull", "no-such-model"], "unknown model"),
])
def test_errors_are_one_line(args, message, smollm2_path, tiny_gguf):
    if "--temperature" in args:
        args = [*args, "--model", tiny_gguf["llama"][0]]
    r = nextoken(*args)
    assert r.returncode == 1
    assert r.stderr.startswith("error: ") and message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [["run", "hi", "--model", "no-such-model"], ["run", "hi", "--temperature", "-1"],
                                  ["chat", "--model", "/nonexistent/x.gguf"], ["explain", "hi", "--top-p", "0"]])
def test_argument_errors_are_found_before_pytorch_is_imported(args):
    """A mistyped model or a bad sampling value is reported at once, not after PyTorch's import."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "nextoken.cli", *args], capture_output=True,
                       text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and lines[-1].startswith("error: "), r.stderr[-500:]
    imported = {line.split("|")[-1].strip() for line in lines if line.startswith("import time:")}
    assert "nextoken.cli" in imported and "torch" not in imported


def test_corrupt_file_is_one_line(tmp_path):
    """A damaged GGUF file is one line, found by the quick start's reader before PyTorch's import."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 50)
    r = nextoken("run", "hi", "--model", bad)
    assert r.returncode == 1 and "error:" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "nextoken.cli", "run", "hi", "--model", str(bad)],
                       capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "not a readable GGUF file" in lines[-1]
    assert "torch" not in {line.split("|")[-1].strip() for line in lines if line.startswith("import time:")}


def test_models_lists_the_catalog(smollm2_path):
    r = nextoken("models")
    assert r.returncode == 0
    for name in ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "gemma-3-270m"):
        assert name in r.stdout
    assert "yes" in r.stdout  # the default model is cached by the fixture


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None, reason="llama-cpp-python is installed")
def test_bench_compare_without_llama_cpp_is_one_line(tiny_gguf):
    r = nextoken("bench", "--model", str(tiny_gguf["llama"][0]), "--compare", "llama.cpp",
                 "--llama-python", sys.executable)
    assert r.returncode == 1 and r.stderr.startswith("error: --compare llama.cpp needs llama-cpp-python"), r.stderr


@pytest.mark.parametrize("kv_dtype,flags", [("auto", []), ("int8", ["-ctk", "q8_0", "-ctv", "q8_0"])])
def test_llama_bench_runs_the_same_workload(tmp_path, kv_dtype, flags):
    """`--llama-bench PATH` hands llama-bench our workload (prompt, decode, depth, repeats,
    threads) and, with ``--kv-cache-dtype int8``, its q8_0 KV cache, so the ratio compares like
    with like; its JSON rows are read back. A stand-in executable records its arguments."""
    from types import SimpleNamespace

    from nextoken.bench import run_llama_bench

    argv_file = tmp_path / "argv.json"
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(argv_file)!r}, 'w').write(json.dumps(sys.argv[1:]))\n"
                    "print(json.dumps([{'n_gen': 0, 'avg_ts': 123.5, 'build_commit': 'abc'},"
                    " {'n_gen': 16, 'avg_ts': 45.25, 'build_commit': 'abc'}]))\n")
    fake.chmod(0o755)
    a = SimpleNamespace(model_path="m.gguf", prompt_tokens=64, decode_tokens=16, depth=512, repeat=2,
                        cold_start=False)
    out = run_llama_bench(str(fake), a, 3, kv_dtype)
    assert out == {"prefill_tok_s": 123.5, "decode_tok_s": 45.25, "version": "abc"}
    argv = json.loads(argv_file.read_text())
    assert argv == ["-m", "m.gguf", "-t", "3", "-o", "json", "-p", "64", "-n", "16", "-d", "512", "-r", "2", *flags]


def test_bench_sampler_row_gives_the_timed_draws_and_names_a_missing_one():
    """The sampler's row gives greedy / sampled ms per step, nextoken's alone; a draw nobody timed
    says so rather than 0 ms, and a figure nobody measured is left out."""
    from types import SimpleNamespace

    from nextoken.bench.harness import format_table

    a = SimpleNamespace(depth=0, temperature=1.0, top_p=1.0, top_k=0, model_path="m.gguf", prompt_tokens=512,
                        decode_tokens=128, batch=32, batch_prompt_tokens=128, batch_output_tokens=128)
    res = {"decode_tok_s": 50.0, "decode_sampler_ms": None, "decode_sampled_sampler_ms": 0.5,
           "batched_sampler_ms": 0.25, "batched_sampled_sampler_ms": 1.5}
    table = format_table({"nextoken": res, "llama-bench": {"decode_tok_s": 25.0}}, a, 2, 2048)
    assert "| sampler per decode step, greedy / sampled (ms) | not timed / 0.50 | n/a |  |" in table
    assert "| sampler per batched step, greedy / sampled (ms) | 0.25 / 1.50 | n/a |  |" in table
    assert "| decode, greedy (tok/s) | 50.0 | 25.0 | 2.00x |" in table and "| prefill (tok/s)" not in table


def test_sampler_clock_times_every_draw_the_engine_makes(tiny_gguf):
    """The engine draws a decode step's plain rows through `Sampler.draw_checked`, other steps
    through the call itself: the bench's clock times both, one time per draw, and puts the
    engine's own sampler back."""
    from nextoken import LLM, SamplingParams
    from nextoken.bench.worker import SamplerClock

    llm = LLM(str(tiny_gguf["llama"][0]), max_num_seqs=2)
    sampler = llm.engine.sampler
    with SamplerClock(llm) as plain:
        llm.generate(["a b c"], SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True))
    with SamplerClock(llm) as processed:  # (a penalty: not the plain draw)
        llm.generate(["a b c"], SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=6, ignore_eos=True))
    assert len(plain.times) == 6 and len(processed.times) == 6
    assert plain.ms_per_step() > 0 and processed.ms_per_step() > 0 and llm.engine.sampler is sampler


def test_bench_prints_its_figures_when_llama_bench_fails(tiny_gguf, tmp_path):
    """A llama-bench that fails (a build for another CPU, a run stopped by hand) costs its column,
    not the minutes of our own figures: they are printed, the failure is named, the exit is 1."""
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!{sys.executable}\nimport sys\nsys.stderr.write('illegal instruction\\n')\nsys.exit(132)\n")
    fake.chmod(0o755)
    out = tmp_path / "bench.json"
    r = nextoken("bench", "--model", str(tiny_gguf["llama"][0]), "--prompt-tokens", "32", "--decode-tokens", "8",
                 "--repeat", "1", "--no-batched", "--threads", "1", "--llama-bench", str(fake), "--json", str(out))
    assert r.returncode == 1
    assert "error: llama-bench failed: illegal instruction" in r.stderr
    res = json.loads(out.read_text())["results"]
    assert "llama-bench" not in res
    assert f"{res['nextoken']['decode_tok_s']:.1f}" in r.stdout


def test_bench_reports_every_figure_alternating_with_llama_bench(tiny_gguf, tmp_path):
    """`nextoken bench` on a tiny model with `--llama-bench` and `--rounds 2`: each figure measured
    in its own process (the batched run really produced every token: the worker checks), the
    table and the JSON agree; nextoken's single-stream run and llama-bench's alternate (a stand-in
    counts its calls), each round's pair and ratio are printed with the median ratio, the table
    holds the medians, and the header names the CPU and our matmul's loop."""
    calls = tmp_path / "calls"
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!{sys.executable}\nimport json\n"
                    f"with open({str(calls)!r}, 'a') as f: f.write('x')\n"
                    "print(json.dumps([{'n_gen': 0, 'avg_ts': 1000.0, 'build_commit': 'abc'},"
                    " {'n_gen': 8, 'avg_ts': 2000.0, 'build_commit': 'abc'}]))\n")
    fake.chmod(0o755)
    out = tmp_path / "bench.json"
    r = nextoken("bench", "--model", str(tiny_gguf["llama"][0]), "--prompt-tokens", "32", "--decode-tokens", "8",
                 "--batch", "3", "--batch-prompt-tokens", "8", "--batch-output-tokens", "4", "--repeat", "1",
                 "--threads", "1", "--llama-bench", str(fake), "--rounds", "2", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert calls.read_text() == "xx"
    data = json.loads(out.read_text())
    res = data["results"]["nextoken"]
    for key in ("prefill_tok_s", "decode_tok_s", "batched_tok_s", "peak_rss_mib"):
        assert res[key] > 0
        assert f"{res[key]:.1f}" in r.stdout
    assert res["threads"] == 1
    rounds = data["rounds"]
    assert len(rounds) == 2 and all(p["llama-bench"]["decode_tok_s"] == 2000.0 for p in rounds)
    ours = sorted(p["nextoken"]["decode_tok_s"] for p in rounds)
    assert res["decode_tok_s"] == pytest.approx(sum(ours) / 2)  # the median of two
    assert "alternated rounds" in r.stdout and r.stdout.count("| 1 | ") == 1 and r.stdout.count("| 2 | ") == 1
    ratios = sorted(p["nextoken"]["decode_tok_s"] / 2000.0 for p in rounds)
    assert f"{sum(ratios) / 2:.2f}x |" in r.stdout.split("| median |")[1]
    assert r.stdout.startswith("CPU: ") and "our quantized matmul:" in r.stdout and data["cpu"].startswith("CPU: ")
    assert "not timed" not in r.stdout  # (the engine's draws are timed, greedy and sampled)
