"""``nextoken serve --api-server-count N`` (`server.api_servers`): N HTTP server processes over
one engine process, as a user starts it. The routing of outputs to the front end that added the
request is `tests/server/test_engine_process.py`'s two-front-ends test."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from nextoken import LLM, SamplingParams
from tests.ports import free_ports

pytestmark = pytest.mark.subprocess


def _children(pid: int) -> list[int]:
    return [int(c) for t in os.listdir(f"/proc/{pid}/task") for c in open(f"/proc/{pid}/task/{t}/children").read().split()]


def _spawned(pid: int) -> list[int]:
    """The launcher's `multiprocessing` children (the engine process and the server processes)."""
    return [c for c in _children(pid) if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]


def _start(model: str, *flags: str, client: httpx.Client | None = None):
    """The launcher and its URL once ``/health`` answers 200 (asked on `client`'s connection,
    else on a new connection each time)."""
    port = free_ports(1)
    proc = subprocess.Popen([sys.executable, "-m", "nextoken.cli", "serve", "--model", model, "--port", str(port),
                             "--dtype", "float32", "--shutdown-timeout", "20", "--api-server-count", "2", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        try:
            if (client or httpx).get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not become healthy")


def _metric(text: str, name: str) -> float:
    return sum(float(m) for m in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_two_server_processes_serve_one_engine_and_stop_on_sigterm(tiny_gguf):
    """Concurrent streams (on connections the two server processes share out) equal
    `LLM.generate`'s greedy tokens; /metrics, whichever process answers, counts every request and
    token once; the inspector answers through either process (its logit lens picks the greedy
    token); loading an adapter at runtime is refused naming the flag; SIGTERM mid-stream lets the
    stream end, the launcher exits 0, and no process is left.

    First, every request over one kept-alive connection (so one server process gets them all):
    the engine process sends every server process each step's counts (about 700 bytes), requests
    or not, and the other one reads them all the same: 4 x 200 steps, more counts than its pipe
    holds unread (64 KiB), all finish. (It read its pipe only from its first request on: the
    engine process then waited on that full pipe after about 100 steps, and every request with it.)"""
    path = str(tiny_gguf["llama"][0])
    prompts = [f"the cat {w} on the" for w in ("sat", "ran", "slept", "jumped", "hid", "sang", "ate", "fell")]
    llm = LLM(path, dtype="float32")
    want = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                                            ignore_eos=True))]
    nxt = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]
    long = llm.generate("the cat", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))[0].outputs[0].text
    one = httpx.Client(timeout=30, limits=httpx.Limits(max_connections=1))
    proc, url = _start(path, client=one)
    try:
        body = {"prompt": "the cat", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
        for _ in range(4):
            r = one.post(url + "/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == long
        one.close()
        spawned = _spawned(proc.pid)
        assert len(spawned) == 3  # the engine process and two server processes
        for pid in spawned:  # only the engine process loads PyTorch
            assert ("libtorch" in open(f"/proc/{pid}/maps").read()) == (not _is_front_end(pid))
        got = [None] * len(prompts)

        def stream(k):
            body = {"prompt": prompts[k], "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
            text = ""
            with httpx.Client(base_url=url, timeout=60) as h, h.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
            got[k] = text

        threads = [threading.Thread(target=stream, args=(k,)) for k in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert got == want
        for _ in range(4):  # (a new connection each: either process may answer)
            text = httpx.get(url + "/metrics").text
            assert _metric(text, "vllm:request_success_total") == 4 + len(prompts)
            assert _metric(text, "nextoken_generation_tokens_total") == 4 * 200 + 24 * len(prompts)
            # the gauges are the last counts the answering process read from its pipe: a step behind
            # at most while its event loop reads that step (once, under a loaded test run, it answered first)
            for _ in range(50):
                if _metric(text, "vllm:num_requests_running") == 0:
                    break
                time.sleep(0.1)
                text = httpx.get(url + "/metrics").text
            assert _metric(text, "vllm:num_requests_running") == 0
        for _ in range(4):  # the inspector, served by the engine process, through either server process
            trace = httpx.post(url + "/inspect/api/trace", json={"prompt": prompts[0], "chat": False}).json()
            n = len(trace["tokens"])
            lens = httpx.get(url + f"/inspect/api/trace/{trace['trace_id']}/lens", params={"position": n - 1}).json()
            assert lens["layers"][-1]["top"][0]["id"] == nxt
        r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/nowhere"})
        assert r.status_code == 400 and "--api-server-count" in r.json()["error"]["message"]

        body = {"prompt": "the cat", "max_tokens": 150, "temperature": 0, "ignore_eos": True, "stream": True}
        lines = []
        with httpx.Client(base_url=url, timeout=60) as h, h.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line and not lines:
                    os.kill(proc.pid, signal.SIGTERM)  # mid-stream
                if line:
                    lines.append(line)
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
        assert all(_gone(pid) for pid in spawned)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_an_engine_process_that_dies_stops_the_service_with_status_1(tiny_gguf):
    """The engine process killed: each server process exits 1 (its streams fail), and so does the
    launcher; no process is left."""
    proc, url = _start(str(tiny_gguf["llama"][0]))
    try:
        spawned = _spawned(proc.pid)
        engine = [pid for pid in spawned if not _is_front_end(pid)]
        assert len(engine) == 1
        os.kill(engine[0], signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        for _ in range(300):
            if all(_gone(pid) for pid in spawned):
                break
            time.sleep(0.1)
        assert all(_gone(pid) for pid in spawned)
    finally:
        if proc.poll() is None:
            proc.kill()


def _exit_on_sigterm(code):
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    if code is not None:
        os._exit(code)
    time.sleep(60)


def test_a_server_process_that_exits_stops_the_others():
    """The launcher's supervision (`_supervise`, over stand-in processes): one server process
    exits with status 3, the other is sent SIGTERM and the launcher's status is 1, after the
    engine process has ended."""
    import multiprocessing

    from nextoken.server.api_servers import _supervise

    ctx = multiprocessing.get_context("fork")
    servers = [ctx.Process(target=_exit_on_sigterm, args=(code,), name=f"nextoken-api-{k}")
               for k, code in enumerate([None, 3])]
    engine = ctx.Process(target=time.sleep, args=(0.5,))
    for p in [*servers, engine]:
        p.start()
    assert _supervise(servers, engine) == 1
    assert [p.exitcode for p in servers] == [0, 3] and engine.exitcode == 0


def _launcher(ready):
    """A stand-in launcher: starts a server process that watches it, says its pid, waits."""
    import multiprocessing

    from nextoken.server.api_servers import _stop_with_launcher

    def server():
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        threading.Thread(target=_stop_with_launcher, daemon=True).start()
        time.sleep(60)
        os._exit(5)

    child = multiprocessing.get_context("fork").Process(target=server)
    child.start()
    ready.put(child.pid)
    time.sleep(60)


def test_a_server_process_stops_when_its_launcher_is_killed():
    """`_stop_with_launcher`: the launcher killed (SIGKILL: it stops nothing), its server process
    sees it gone and stops as on SIGTERM, instead of living on with the port."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    ready = ctx.Queue()
    launcher = ctx.Process(target=_launcher, args=(ready,))
    launcher.start()
    server = ready.get(timeout=30)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.join(10)
    for _ in range(100):
        if _gone(server):
            break
        time.sleep(0.05)
    assert _gone(server)


def _is_front_end(pid: int) -> bool:
    """Whether `pid` runs a server process (it holds the listening socket: a TCP socket among
    its descriptors; the engine process holds none)."""
    fds = f"/proc/{pid}/fd"
    inodes = set()
    for fd in os.listdir(fds):
        try:
            target = os.readlink(f"{fds}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    tcp = open("/proc/net/tcp").read() + open("/proc/net/tcp6").read()
    return any(f" {i} " in tcp for i in inodes)


def test_what_several_server_processes_do_not_serve_is_refused(tiny_gguf):
    """Tensor parallelism and an embedding model beside the model with ``--api-server-count 2``:
    `InvalidRequest` naming the flag (the command line's one-line error), before any process
    starts."""
    from nextoken.engine_args import EngineArgs
    from nextoken.errors import InvalidRequest
    from nextoken.server.api_servers import check
    from nextoken.server.args import ServerArgs

    path = str(tiny_gguf["llama"][0])
    with pytest.raises(InvalidRequest, match="--api-server-count") as e:
        check(EngineArgs(model=path, tensor_parallel_size=2), ServerArgs(api_server_count=2))
    assert e.value.field == "api_server_count"
    with pytest.raises(InvalidRequest, match="--api-server-count 1"):
        check(EngineArgs(model=path), ServerArgs(api_server_count=2, embedding_model=path))
