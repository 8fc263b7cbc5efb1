"""Shared fixtures: tiny GGUF models built from `transformers`, and the real default model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


def pytest_configure(config):
    """Each of pytest-xdist's N workers computes with cores/N threads (`OMP_NUM_THREADS`, which
    PyTorch, our kernels' OpenMP and every `nextoken` process the tests start read), and OpenMP
    threads that wait sleep instead of spinning (`OMP_WAIT_POLICY`): two workers each running two
    spinning threads on two cores keep a core's threads spinning at barriers while the other
    worker's threads hold it. Set here, before anything imports torch (OpenMP reads both once).

    Triton's kernels (`nextoken.kernels.gpu`) run under Triton's interpreter
    (``TRITON_INTERPRET=1``, read when a kernel is defined) unless the environment says otherwise:
    benchmarks/gpu_check.py sets ``TRITON_INTERPRET=0`` to run the same tests compiled on a GPU.
    The interpreter's deep calls would map and unmap a frame-stack chunk on every call across a
    chunk's boundary: freed chunks are kept for reuse (`tests/helpers/arena_cache.py`); and it
    evaluates overflow checks that it then discards, lists the language's builtins again on
    every launch, patches the language again on every device function's call, converts dtypes
    the long way and builds each value's type and shape anew: none of that is done here
    (`tests/helpers/triton_interpreter.py`)."""
    import sys

    from tests.helpers import arena_cache, triton_interpreter

    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("NEXTOKEN_HUGE_PAGES", "0")  # (NO_ARENA below; `huge_pages_on` for the tests of it)
    if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        if "torch" in sys.modules:  # a plugin loaded it first: OpenMP has read its settings already
            sys.modules["torch"].set_num_threads(threads)
    _one_ssl_context_for_httpx()
    arena_cache.install()
    if os.environ["TRITON_INTERPRET"] == "1":
        triton_interpreter.install()


# The modules that take longest (a timeline of each test's start and end, 2026-11-30), first:
# pytest-xdist hands whole files to its two workers in collection order (``--dist loadfile
# --no-loadscope-reorder``, the Makefile's), so the long ones start early and the many short ones
# even the two out at the end.
SLOWEST_FIRST = ("tests/engine/test_gpu_path.py", "tests/server/test_openapi_contract.py",
                 "tests/inspector/test_inspect_browser.py", "tests/models/test_real_model.py",
                 "tests/engine/test_tensor_parallel.py", "tests/cli/test_cli.py", "tests/inspector/test_inspect.py",
                 "tests/engine/test_structured.py", "tests/server/test_server.py", "tests/server/test_api_servers.py",
                 "tests/models/test_lora.py", "tests/engine/test_engine.py", "tests/server/test_router.py",
                 "tests/server/test_engine_process.py", "tests/models/test_embeddings.py",
                 "tests/server/test_lm_eval.py", "tests/engine/test_quick_start.py", "tests/server/test_mcp.py",
                 "tests/server/test_tools_and_formats.py", "tests/engine/test_speculative.py")


def pytest_collection_modifyitems(config, items):
    """Run `SLOWEST_FIRST`'s modules first (a stable sort: each module's own order is kept)."""
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def _one_ssl_context_for_httpx():
    """httpx builds a new SSL context for every client, loading certifi's CA bundle: 38 ms of CPU
    here for each `httpx.get`/`httpx.post` and each SDK client (openai, anthropic), paid even for
    plain HTTP. The tests' traffic is plain HTTP to 127.0.0.1, so one default context, built once,
    serves every client in this process (a client that asks for other settings still gets its
    own). If httpx moves the function, nothing is patched: only speed depends on it."""
    import functools

    import httpx._transports.default as transports

    build = getattr(transports, "create_ssl_context", None)
    if build is None or getattr(build, "shared", False):
        return
    default = functools.cache(lambda: build())

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None and trust_env:
            return default()
        return build(verify=verify, cert=cert, trust_env=trust_env)

    create_ssl_context.shared = True
    transports.create_ssl_context = create_ssl_context


@pytest.fixture
def two_threads():
    """PyTorch and our kernels (one libgomp) compute with two threads in this test, whatever the
    worker's count: a test of the threaded partitions, reductions and barriers uses it. An `LLM`
    built in the test sets its own count (``num_threads``)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """``{arch: (gguf path, transformers model)}`` for the tiny llama, qwen2 and gemma3 models."""
    from tests.tiny_models import tiny_hf_model, write_gguf

    out = {}
    d = tmp_path_factory.mktemp("tiny")
    for arch in ("llama", "qwen2", "gemma3"):
        model = tiny_hf_model(arch)
        path = d / f"tiny-{arch}.gguf"
        write_gguf(model, path, arch)
        out[arch] = (path, model)
    return out


@pytest.fixture(scope="session")
def smollm2_path():
    """Path of the real SmolLM2-135M-Instruct GGUF (pulled once into the cache, SHA-256 verified)."""
    from nextoken.catalog import pull

    return pull("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """`transformers`' float32 load of the same SmolLM2 GGUF (its own de-quantization): the
    independent oracle for tests on the real model. Loading takes seconds: share it.

    transformers opens the file with gguf-py's `GGUFReader` twice (each parses the 49k-token
    vocabulary in Python, about 7 s) and builds gguf-py's `TensorNameMap` once per tensor (397
    times): during the load both are memoised, so it reads the same file and maps the same names
    once each, and the reader's file is a plain array (`tests/helpers/gguf_reader.py`); what it
    computes is unchanged."""
    import functools
    from unittest import mock

    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    from tests.helpers.gguf_reader import plain_arrays

    with mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)), \
            mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)), plain_arrays():
        return AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                                    dtype=torch.float32)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path):
    """One `LLM` on SmolLM2-135M-Instruct with the default settings (bf16, our kernels), shared by
    every test that only generates with it: build your own to change a setting or the engine's
    state."""
    from nextoken import LLM

    llm = LLM(str(smollm2_path))
    yield llm
    llm.close()


# NO_ARENA: the tests' loads keep the weights where the loader put them (``NEXTOKEN_HUGE_PAGES=0``,
# set in `pytest_configure` for this process and every process it starts): the huge-page arena's
# copy faults them in in 2 MiB pages, which on these VMs ran at 0.12-0.5 GB/s on fresh memory
# against 2-3 GB/s for 4 KiB pages (seconds a load: 40 s of the suite's CPU on 2026-12-03), and it
# changes where the bytes live, not what they are: the tests of the arena itself (`huge_pages_on`)
# hold that outputs are bit for bit the same.
@pytest.fixture
def huge_pages_on(monkeypatch):
    """This test's loads place the weights in the huge-page arena as a user's do (`NO_ARENA`)."""
    monkeypatch.setenv("NEXTOKEN_HUGE_PAGES", "1")


@pytest.fixture(scope="session")
def smollm2_f32(smollm2_path):
    """One float32 `LLM` on SmolLM2 (the reference path's numbers), shared like `smollm2_llm`.
    It must not be stepped from a test while `smollm2_server` serves it: that server has its own."""
    from nextoken import LLM

    llm = LLM(str(smollm2_path), dtype="float32")
    yield llm
    llm.close()


@pytest.fixture(scope="session")
def smollm2_server(smollm2_path):
    """A live server (uvicorn in a thread, `helpers.server.LiveServer`) on a float32 SmolLM2
    engine of its own, served as "smollm2", shared by every test that only sends it requests."""
    from nextoken import LLM
    from tests.helpers.server import LiveServer

    srv = LiveServer(LLM(str(smollm2_path), dtype="float32"), "smollm2")
    yield srv
    srv.stop()


def load_reference(name: str) -> dict:
    """Reference outputs made by `transformers` from the real GGUF files (tests/data)."""
    return json.loads((DATA / f"{name}.json").read_text())
