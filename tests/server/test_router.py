"""Replicas behind vllm-router: `nextoken serve --replicas 2` (two SmolLM2 servers, each pinned to
its own core, and the router in front), and the documented ``vllm-router`` command in front of
the same replicas.

Everything runs in a network namespace of its own when the machine allows one (root, or user
namespaces): only loopback exists there, so nothing the router or the servers do can reach the
network (checked: a connection to an outside address fails at once).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager

import httpx
import pytest

from nextoken.errors import InvalidRequest
from nextoken.server.replicas import core_slices, replica_argv, router_command
from tests.helpers.server import wait_healthy
from tests.ports import free_ports

pytestmark = pytest.mark.subprocess  # every test here starts processes of its own

CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
MODEL = "smollm2-135m-instruct"


# -- a network of our own ---------------------------------------------------------------------
@contextmanager
def loopback_only():
    """Move this thread into a new network namespace with only loopback up (the processes it
    starts inherit it), and back afterwards. Yields True, or False where the kernel refuses
    (no privilege): then the tests run on the host's loopback."""
    libc = ctypes.CDLL(None, use_errno=True)
    original = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        if libc.unshare(CLONE_NEWNET) != 0:
            warnings.warn(f"no network namespace ({os.strerror(ctypes.get_errno())}): the router tests run on the "
                          "host's loopback")
            yield False
            return
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                flags = struct.unpack("16sH22x", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH22x", b"lo", 0)))[1]
                fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))
            yield True
        finally:
            if libc.setns(original, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "could not return to the original network namespace")
    finally:
        os.close(original)


def metric(url: str, name: str) -> float:
    """The value of one vLLM-named metric of a replica (summed over its label sets)."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Cluster:
    """`nextoken serve --replicas 2` on ports base (router), base+1 and base+2 (replicas)."""

    def __init__(self, smollm2_path, policy="cache_aware"):
        self.base = free_ports(4)
        self.log = tempfile.TemporaryFile("w+")  # the replicas' and the router's output, shown on a failure
        self.kv_dir = tempfile.TemporaryDirectory()  # the replicas' shared KV disk tier
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nextoken", "serve", "--model", MODEL, "--port", str(self.base), "--replicas", "2",
             "--router-policy", policy, "--max-model-len", "2048", "--kv-cache-memory", "128MiB", "--log-level",
             "warning", "--kv-cache-dir", self.kv_dir.name], stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)
        self.url = f"http://127.0.0.1:{self.base}"
        self.replicas = [f"http://127.0.0.1:{self.base + i}" for i in (1, 2)]
        try:
            for url in (self.url, *self.replicas):  # the tests also talk to each replica directly
                wait_healthy(url, self.proc)
            self._wait_router_sees_all()
        except BaseException:
            self.stop()
            self.log.seek(0)
            print(self.log.read()[-4000:])
            raise

    def _wait_router_sees_all(self, timeout: float = 60) -> None:
        """Until the router counts every replica healthy (its ``/workers``) and reads their loads:
        its view lags the replicas' own /health by its checks (every 5 s), and a replica it holds
        unhealthy gets no request."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                workers = httpx.get(self.url + "/workers", timeout=5).json()["workers"]
                loads = httpx.get(self.url + "/get_loads", timeout=5).json()["workers"]
                if len(workers) == len(self.replicas) and all(w["is_healthy"] for w in workers) and \
                        all(w["load"] >= 0 for w in loads):
                    return
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the router does not see every replica healthy: {self.router_view()}")

    def router_view(self) -> str:
        try:
            return httpx.get(self.url + "/workers", timeout=5).text
        except httpx.HTTPError as exc:
            return repr(exc)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait()
        self.kv_dir.cleanup()
        return code

    def replica_pids(self) -> list[int]:
        """The replicas' processes, in port order (children of the `--replicas` process)."""
        out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(self.proc.pid)], capture_output=True, text=True)
        found = {}
        for line in out.stdout.splitlines():
            pid, args = line.strip().split(" ", 1)
            for i, port in enumerate((self.base + 1, self.base + 2)):
                if f"--port {port}" in args:
                    found[i] = int(pid)
        assert len(found) == 2, out.stdout
        return [found[0], found[1]]


@pytest.fixture(scope="module")
def network():
    with loopback_only() as isolated:
        if isolated:  # the check that nothing leaves: an outside address is unreachable at once
            with socket.socket() as s, pytest.raises(OSError) as exc:
                s.settimeout(2)
                s.connect(("192.0.2.1", 80))
            assert exc.value.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH)
        yield isolated


@pytest.fixture(scope="module")
def cluster(network, smollm2_path):
    c = Cluster(smollm2_path)
    yield c
    assert c.stop() == 0


def complete(url: str, prompt: str, max_tokens: int = 8) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                                   "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


# -- pieces of --replicas ----------------------------------------------------------------------
def test_core_slices_and_replica_arguments():
    assert core_slices([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert core_slices([0, 1, 2], 2) == [[0], [1]]
    with pytest.raises(InvalidRequest, match="--replicas 3 needs at least 3 cores"):
        core_slices([0, 1], 3)
    argv = ["--model", "m", "--replicas", "2", "--port=9000", "--host", "0.0.0.0", "--router-policy", "round_robin",
            "--threads", "1"]
    assert replica_argv(argv) == ["--model", "m", "--threads", "1"]
    cmd = router_command("vllm-router", "0.0.0.0", 9000, "cache_aware", ["http://a:1", "http://b:2"], 9003)
    assert cmd[:9] == ["vllm-router", "--host", "0.0.0.0", "--port", "9000", "--policy", "cache_aware",
                       "--worker-urls", "http://a:1"]


def test_the_router_waits_for_every_replica_still_running(caplog):
    """`serve --replicas` starts the router once every live replica answers /health (stand-ins: one
    that exits at once, one that answers after a while); it gives up when every replica exited."""
    import http.server
    import threading

    from nextoken.server.replicas import _wait_replicas

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if time.monotonic() > ready_at else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    def exits(code):
        return subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])

    def waits():
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    port = free_ports(2)
    ready_at = time.monotonic() + 1.0
    health = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)
    threading.Thread(target=health.serve_forever, daemon=True).start()
    procs = [("replica 0", waits()), ("replica 1", exits(3))]
    try:
        assert _wait_replicas(procs, [port, port + 1], {"signal": None})
        assert time.monotonic() > ready_at  # not before the live one answered 200
        assert _wait_replicas(procs, [port, port + 1], {"signal": signal.SIGTERM}) is False
    finally:
        health.shutdown()
        health.server_close()
        procs[0][1].kill()
        procs[0][1].wait()
    dead = [("replica 0", exits(4)), ("replica 1", exits(5))]
    with caplog.at_level("WARNING", logger="nextoken.server"):
        assert _wait_replicas(dead, [port, port + 1], {"signal": None}) is False
    assert "replica 1 exited with status 5" in caplog.text and "every replica has exited" in caplog.text


# -- the cluster ----------------------------------------------------------------------------
def test_replicas_are_pinned_to_disjoint_cores(cluster):
    slices = [os.sched_getaffinity(pid) for pid in cluster.replica_pids()]
    assert slices[0] and slices[1] and not slices[0] & slices[1]


def test_greedy_output_through_the_router_equals_a_direct_request(cluster):
    prompt = "The three primary colors are"
    direct = complete(cluster.replicas[0], prompt)["choices"][0]["text"]
    assert complete(cluster.url, prompt)["choices"][0]["text"] == direct
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name a planet."}], "max_tokens": 8,
            "temperature": 0}
    direct = httpx.post(cluster.replicas[1] + "/v1/chat/completions", json=chat, timeout=60).json()
    routed = httpx.post(cluster.url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert routed["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]


def test_router_reads_the_replicas_models_and_loads(cluster):
    assert httpx.get(cluster.url + "/v1/models", timeout=10).json()["data"][0]["id"] == MODEL
    loads = httpx.get(cluster.url + "/get_loads", timeout=10).json()["workers"]
    assert sorted(w["worker"] for w in loads) == cluster.replicas
    assert all(w["load"] >= 0 for w in loads)  # -1 is the router's "could not read"


def test_eight_concurrent_clients_reach_both_replicas(cluster):
    cluster._wait_router_sees_all()  # (a replica the router held unhealthy would get none)
    before = [metric(u, "vllm:request_success_total") for u in cluster.replicas]
    prompts = [f"{i}: {topic}" for i, topic in enumerate(
        ["Rivers of Europe", "How bread rises", "A poem about rain", "Prime numbers", "The moon landing",
         "Why cats purr", "Volcanoes", "Chess openings", "Ocean tides", "Bees and flowers", "The printing press",
         "Glaciers", "Jazz music", "Solar panels", "Paper planes", "Coffee"])]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: complete(cluster.url, p, max_tokens=16), prompts))
    assert all(o["choices"][0]["text"] for o in outs)
    served = [metric(u, "vllm:request_success_total") - b for u, b in zip(cluster.replicas, before)]
    assert sum(served) == len(prompts) and min(served) > 0, (served, cluster.router_view())


def conversation_replay(url: str, tag: str, turns: int = 4, conversations: int = 3) -> None:
    """Multi-turn chats, interleaved turn by turn: each turn resends the conversation so far (an odd
    number of conversations, so that round-robin moves each one between the two replicas)."""
    chats = [[{"role": "system", "content": f"{tag} conversation {c}: you are a helpful assistant who answers "
                                            f"briefly about topic number {c} of a long list of topics. " * 3}]
             for c in range(conversations)]
    for t in range(turns):
        for c, messages in enumerate(chats):
            messages.append({"role": "user", "content": f"Question {t} about topic {c}?"})
            r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 6,
                                                               "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})


def test_cache_aware_routing_hits_the_prefix_cache_more_than_round_robin(cluster):
    """The same replay through the `--replicas` router (cache_aware) and through the documented
    vllm-router command with round_robin in front of the same replicas: cache_aware keeps each
    conversation on one replica, so more of its prompt tokens come from its RAM prefix cache
    (the hits less those read back from the shared disk tier)."""
    def hits():
        return sum(metric(u, "vllm:prefix_cache_hits_total") - metric(u, "vllm:external_prefix_cache_hits_total")
                   for u in cluster.replicas)

    start = hits()
    conversation_replay(cluster.url, "alpha")
    cache_aware = hits() - start
    port = free_ports(2)
    log = tempfile.TemporaryFile("w+")
    router = subprocess.Popen(router_command(os.path.join(os.path.dirname(sys.executable), "vllm-router"), "127.0.0.1",
                                             port, "round_robin", cluster.replicas, port + 1),
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", router, timeout=60, log=log)
        start = hits()
        conversation_replay(f"http://127.0.0.1:{port}", "bravo")
        round_robin = hits() - start
    finally:
        router.terminate()
        router.wait(timeout=30)
    print(f"prefix-cache tokens hit: cache_aware {cache_aware:.0f}, round_robin {round_robin:.0f}")
    assert cache_aware > 1.3 * round_robin, (cache_aware, round_robin)


def test_a_prefix_one_replica_computed_is_read_back_by_the_other(cluster):
    """The replicas share one disk tier: a long prompt sent to replica 1, then to replica 2,
    is read back from disk on replica 2 (its external hits grow by the prompt's full blocks but
    the last), with the same greedy answer."""
    prompt = "Shared document for both replicas. " * 40 + "Summary:"
    first = complete(cluster.replicas[0], prompt)
    n = first["usage"]["prompt_tokens"]
    written, deadline = -1.0, time.time() + 30  # replica 1 writes its blocks in the background
    while time.time() < deadline:
        now = metric(cluster.replicas[0], "nextoken_kv_disk_written_bytes_total")
        if now > 0 and now == written:
            break
        written = now
        time.sleep(0.5)
    before = metric(cluster.replicas[1], "vllm:external_prefix_cache_hits_total")
    second = complete(cluster.replicas[1], prompt)
    got = metric(cluster.replicas[1], "vllm:external_prefix_cache_hits_total") - before
    assert got >= (n - 1) // 16 * 16 - 16, (got, n)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_a_killed_replica_leaves_the_router_serving_on_the_other(cluster):
    """The last test of this file: it kills a replica of the module's cluster (whose teardown
    then checks that the --replicas process still exits cleanly), rather than starting a cluster
    of its own."""
    c = cluster
    complete(c.url, "Warm words")
    victim, survivor = c.replica_pids()[0], c.replicas[1]
    before = metric(survivor, "vllm:request_success_total")
    os.kill(victim, signal.SIGKILL)
    prompts = [f"After the failure, request {i} says" for i in range(6)]
    outs = [complete(c.url, p) for p in prompts]  # every one succeeds (the router retries elsewhere)
    assert all(o["choices"][0]["text"] for o in outs)
    assert metric(survivor, "vllm:request_success_total") - before == len(prompts)
    assert c.proc.poll() is None  # the --replicas process keeps serving with one replica
