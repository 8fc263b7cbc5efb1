"""`EngineArgs`: every engine option reaches the engine, from every command that builds one.

Each command runs for real (`nextoken.cli.main`) up to the point where the engine is built;
`LLMEngine.from_engine_args`, the one place an engine is built, is replaced by a recorder.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from nextoken import cli
from nextoken.engine.engine import LLMEngine
from nextoken.cli_args import parse_size
from nextoken.engine_args import EngineArgs
from nextoken.errors import InvalidRequest, NextokenError

MiB = 2**20


class Built(NextokenError):
    """Raised by the recorder instead of building an engine."""


def settings(model: str, speculative: str) -> tuple[list[str], dict]:
    """Command-line flags that set every engine option away from its default, and the values the
    engine must then see. `speculative`: "ngram" or "draft" (they exclude each other)."""
    argv = ["--model", model, "--dtype", "float32", "--threads", "1", "--enforce-eager", "--reference-attention",
            "--dense-weights", "--max-model-len", "100", "--kv-cache-memory", "3MiB", "--num-kv-blocks", "7",
            "--block-size", "8", "--max-num-seqs", "5", "--max-num-batched-tokens", "300", "--no-chunked-prefill",
            "--scheduling-policy", "fair",
            "--num-speculative-tokens", "3", "--speculative-draft-vocab", "0", "--watermark-gamma", "0.25", "--watermark-delta", "3.5",
            "--chat-template", "t.jinja", "--no-prepared-cache", "--no-huge-pages", "--kv-cache-dtype", "int8", "--tensor-parallel-size", "2",
            "--kv-cache-dir", "kv", "--kv-cache-disk", "5MiB", "--enable-lora", "--max-loras", "3",
            "--max-lora-rank", "8", "--quantization", "q4_0", "--device", "cuda:1", "--attention-backend", "torch",
            "--gpu-memory-utilization", "0.5", "--batch-invariant", "--stream-interval", "6",
            "--async-scheduling", "--trust-remote-code", "--seed", "9", "--generation-config", "vllm",
            "--override-generation-config", '{"temperature": 0.5, "max_new_tokens": 7}', "--max-logprobs", "-1"]
    want = {"model": model, "dtype": "float32", "num_threads": 1, "enforce_eager": True, "reference_attention": True,
            "dense_weights": True, "max_model_len": 100, "kv_cache_memory": 3 * MiB, "num_kv_blocks": 7,
            "block_size": 8, "max_num_seqs": 5, "max_num_batched_tokens": 300, "enable_chunked_prefill": False,
            "scheduling_policy": "fair",
            "num_speculative_tokens": 3, "speculative_draft_vocab": 0, "watermark_gamma": 0.25, "watermark_delta": 3.5,
            "chat_template": "t.jinja", "prepared_cache": False, "huge_pages": False, "kv_cache_dtype": "int8",
            "tensor_parallel_size": 2, "kv_cache_dir": "kv", "kv_cache_disk": 5 * MiB,
            "enable_lora": True, "max_loras": 3, "max_lora_rank": 8, "quantization": "q4_0", "device": "cuda:1",
            "attention_backend": "torch", "gpu_memory_utilization": 0.5, "batch_invariant": True, "stream_interval": 6,
            "async_scheduling": True, "trust_remote_code": True, "seed": 9, "generation_config": "vllm",
            "override_generation_config": {"temperature": 0.5, "max_new_tokens": 7}, "max_logprobs": -1}
    if speculative == "ngram":
        argv += ["--speculative-method", "ngram"]
        want.update(speculative_method="ngram", speculative_model=None)
    else:
        argv += ["--speculative-model", model]
        want.update(speculative_model=model, speculative_method=None)
    return argv, want


def test_the_settings_cover_every_flag():
    """A new engine option must be added to `settings` (and so to every command's test)."""
    covered = set(settings("m", "ngram")[1]) | set(settings("m", "draft")[1]) | {"enable_prefix_caching"}
    assert covered == {f.name for f in EngineArgs.cli_fields()}


@pytest.fixture
def built(monkeypatch):
    """The `EngineArgs` each engine build received."""
    seen: list[EngineArgs] = []

    def record(cls, args, opened=None):
        seen.append(args)
        raise Built("engine built")

    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(record))
    return seen


def check(args: EngineArgs, want: dict, skip: tuple[str, ...] = ()) -> None:
    for name, value in want.items():
        if name not in skip:
            assert getattr(args, name) == value, name


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
@pytest.mark.parametrize("command", ["run", "chat", "explain"])
def test_single_user_commands_pass_every_option(built, tiny_gguf, command, speculative):
    flags, want = settings(str(tiny_gguf["llama"][0]), speculative)
    prompt = [] if command == "chat" else ["hi"]
    assert cli.main([command, *prompt, *flags, "--no-prefix-caching"]) == 1  # the recorder's error
    check(built[-1], {**want, "enable_prefix_caching": False, "seed": None})  # (their --seed is the request's)
    assert cli.main([command, *prompt, "--model", want["model"]]) == 1
    assert built[-1].max_num_seqs == 1 and built[-1].enable_prefix_caching  # the single-user defaults


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
def test_serve_passes_every_option(built, tiny_gguf, monkeypatch, speculative):
    """`serve` loads in the background of the server's lifespan; run just that lifespan."""
    import uvicorn

    def run_lifespan(server, sockets=None):
        async def go():
            app = server.config.app
            async with app.router.lifespan_context(app):
                for _ in range(500):
                    if built:
                        break
                    await asyncio.sleep(0.01)
        asyncio.run(go())

    monkeypatch.setattr(uvicorn.Server, "run", run_lifespan)
    flags, want = settings(str(tiny_gguf["llama"][0]), speculative)
    assert cli.main(["serve", *flags, "--no-prefix-caching", "--port", "0"]) == 1  # no model loaded: status 1
    check(built[-1], {**want, "enable_prefix_caching": False})


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
def test_bench_passes_every_option_but_the_workloads(built, tiny_gguf, monkeypatch, speculative):
    """`bench` hands the engine flags to its worker process; run the worker in this process."""
    import nextoken.bench.harness as bench
    from nextoken.bench import worker

    def run_worker(cmd, **kwargs):
        assert cmd[1:3] == ["-m", "nextoken.bench.worker"]  # the worker ships in the package
        a, engine_args = worker.parse(cmd[3:])
        worker.nextoken_worker(a, engine_args)

    monkeypatch.setattr(bench.subprocess, "run", run_worker)
    flags, want = settings(str(tiny_gguf["llama"][0]), speculative)
    flags = [f for i, f in enumerate(flags) if f != "--max-num-seqs" and flags[i - 1] != "--max-num-seqs"]
    assert cli.main(["bench", *flags, "--prefix-caching", "--no-batched", "--repeat", "1"]) == 1
    check(built[-1], {**want, "enable_prefix_caching": True}, skip=("max_num_seqs",))
    assert built[-1].max_num_seqs == 1  # the single-stream workload's
    assert cli.main(["bench", "--model", want["model"], "--no-batched"]) == 1
    assert built[-1].max_model_len == 2048 and not built[-1].enable_prefix_caching  # bench's defaults


def test_llm_passes_every_option(built, tiny_gguf):
    from nextoken.llm import LLM

    _, want = settings(str(tiny_gguf["llama"][0]), "ngram")
    with pytest.raises(Built):
        LLM(**want, enable_prefix_caching=False, auto_pull=False)
    check(built[-1], {**want, "enable_prefix_caching": False, "auto_pull": False})


def test_cli_flags_round_trip():
    """`to_cli_args` (how bench hands the engine flags to its worker) rebuilds the same args."""
    import argparse

    for args in (EngineArgs(), EngineArgs(model="x", dtype="float32", num_threads=3, enforce_eager=True,
                                          kv_cache_memory=5 * MiB, enable_prefix_caching=False,
                                          enable_chunked_prefill=False, speculative_method="ngram")):
        p = argparse.ArgumentParser()
        EngineArgs.add_cli_args(p)
        again = EngineArgs.from_cli_args(p.parse_args(args.to_cli_args()))
        assert dataclasses.asdict(again) == dataclasses.asdict(args)


@pytest.mark.parametrize("field,value", [("block_size", 0), ("max_num_seqs", -1), ("num_threads", 0),
                                          ("dtype", "float16"), ("speculative_method", "medusa"),
                                          ("num_speculative_tokens", 0), ("max_model_len", 2.5),
                                          ("kv_cache_dtype", "fp8"), ("stream_interval", 0), ("max_logprobs", -2)])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(InvalidRequest) as e:
        EngineArgs(**{field: value})
    assert e.value.field == field


def test_bad_flag_value_is_one_line(tiny_gguf, capsys):
    assert cli.main(["run", "hi", "--model", str(tiny_gguf["llama"][0]), "--block-size", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: block_size must be") and len(err.strip().splitlines()) == 1


def test_speculative_combinations():
    assert EngineArgs(speculative_model="m").speculative == "draft"
    assert EngineArgs().speculative is None
    with pytest.raises(InvalidRequest, match="needs speculative_model"):
        EngineArgs(speculative_method="draft")
    with pytest.raises(InvalidRequest, match="takes no speculative_model"):
        EngineArgs(speculative_method="ngram", speculative_model="m")


@pytest.mark.parametrize("text,size", [("512MiB", 512 * MiB), ("2GiB", 2 * 2**30), ("2GB", 2 * 10**9),
                                        ("2G", 2 * 10**9), ("1.5gi", int(1.5 * 2**30)), ("300k", 300_000),
                                        ("64KiB", 65536), ("4096", 4096), (" 1e6 ", 10**6)])
def test_parse_size_units(text, size):
    """SI units are powers of 1000, IEC units (with an i) powers of 1024, never mixed."""
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "abc", "0", "-5MiB", "3 parsecs", "2XB"])
def test_parse_size_refuses(text):
    with pytest.raises(InvalidRequest):
        parse_size(text)


def test_default_threads_are_the_usable_cores_or_fewer_by_omp_num_threads(monkeypatch):
    """As PyTorch reads OMP_NUM_THREADS, and never more threads than cores (they would spin)."""
    import os

    from nextoken.runner.threads import default_threads

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_threads() == cores
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert default_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", str(cores + 3))
    assert default_threads() == cores
    for ignored in ("0", "", "two", "-1"):
        monkeypatch.setenv("OMP_NUM_THREADS", ignored)
        assert default_threads() == cores
