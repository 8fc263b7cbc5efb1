"""`nextoken serve --replicas N`: N plain `nextoken serve` processes behind vllm-router.

A convenience over three commands a user could type: each replica is an ordinary server on
``127.0.0.1:PORT+1 .. PORT+N`` with its threads pinned to its own slice of this process's
cores (``os.sched_setaffinity``: the replicas never compete for a core), and the router
(``vllm-router`` from PyPI, `nextoken[router]`) listens on ``--host:--port`` in front of them:

    vllm-router --host HOST --port PORT --policy cache_aware \\
        --worker-urls http://127.0.0.1:PORT+1 ... --prometheus-port PORT+N+1 \\
        --cb-failure-threshold 3 --health-check-interval-secs 5 --health-failure-threshold 1 \\
        --worker-startup-check-interval 1

The replicas share one prefix-cache disk tier (``--kv-cache-dir``, default ``<cache>/kv``;
``--kv-cache-dir off`` turns it off): full KV blocks one replica computed are read back by the
others instead of recomputed (`kv_cache.disk`).

``cache_aware`` sends requests that share a prompt prefix to the replica that has served that
prefix (the router asks the replicas' ``/tokenize`` for the tokens), so its prefix cache hits;
the circuit breaker and health check settings take a replica that died out of the rotation
after three failed attempts, which the router retries on another replica. Every replica can as
well run on another host: start ``nextoken serve`` there and give its URL to ``vllm-router``.

The router starts once every replica's ``/health`` answers 200 (the model loaded and warm), so it
finds them all healthy at its first check. SIGTERM or Ctrl-C stops the router, then the replicas
(each drains its requests within ``--shutdown-timeout``). A replica that exits is logged and left
out by the router; when the router or every replica has exited, the rest are stopped and the
command exits with status 1.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time

from nextoken.errors import InvalidRequest

log = logging.getLogger("nextoken.server")

# flags of the parent that do not go to the replicas (each replica gets its own --host/--port)
PARENT_ONLY = {"--replicas", "--router-policy", "--port", "--host"}  # each takes a value
# the router's failure handling: out of the rotation after 3 failed attempts (it retries up to
# 5 times, so the request that met the dead replica still succeeds on another), checked every 5 s;
# at start, the replicas are polled every second (not every 30)
ROUTER_FAILOVER = ["--cb-failure-threshold", "3", "--health-check-interval-secs", "5",
                   "--health-failure-threshold", "1", "--worker-startup-check-interval", "1"]


def core_slices(cores: list[int], n: int) -> list[list[int]]:
    """`cores` cut into `n` disjoint slices of equal size (the remainder unused). Raises
    `InvalidRequest` when there are fewer cores than replicas."""
    if n < 1:
        raise InvalidRequest(f"--replicas must be at least 1, got {n}", "replicas")
    if len(cores) < n:
        raise InvalidRequest(f"--replicas {n} needs at least {n} cores this process may use; it has "
                             f"{len(cores)} ({', '.join(map(str, cores))})", "replicas")
    k = len(cores) // n
    return [cores[i * k:(i + 1) * k] for i in range(n)]


def replica_argv(argv: list[str]) -> list[str]:
    """The `serve` arguments a replica inherits: `argv` (after ``serve``) without the flags
    that belong to the parent (`PARENT_ONLY`, in ``--flag value`` or ``--flag=value`` form)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in PARENT_ONLY:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def router_command(router: str, host: str, port: int, policy: str, worker_urls: list[str],
                   prometheus_port: int) -> list[str]:
    return [router, "--host", host, "--port", str(port), "--policy", policy, "--worker-urls", *worker_urls,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port), *ROUTER_FAILOVER]


def find_router() -> str:
    """The ``vllm-router`` executable (beside this Python first, then on PATH). Raises
    `InvalidRequest` when it is not installed."""
    here = os.path.join(os.path.dirname(sys.executable), "vllm-router")
    found = here if os.access(here, os.X_OK) else shutil.which("vllm-router")
    if not found:
        raise InvalidRequest("--replicas needs the router vllm-router: pip install 'nextoken[router]' "
                             "(or pip install vllm-router)", "replicas")
    return found


def serve_replicas(args, argv: list[str]) -> int:
    """Run `args.replicas` replicas and the router until a signal, or until the router or every
    replica has exited (status 1)."""
    router = find_router()
    slices = core_slices(sorted(os.sched_getaffinity(0)), args.replicas)
    ports = [args.port + 1 + i for i in range(args.replicas)]
    rest = replica_argv(argv)
    if args.kv_cache_dir is None and args.kv_cache_disk is None and args.enable_prefix_caching:
        from nextoken.catalog import cache_dir  # one disk tier for all: a prefix one replica computed serves all

        rest += ["--kv-cache-dir", str(cache_dir() / "kv")]
    procs: list[tuple[str, subprocess.Popen]] = []
    stopping = {"signal": None}

    def stop(sig, _frame):
        stopping["signal"] = sig

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for i, (port, cores) in enumerate(zip(ports, slices)):
            cmd = [sys.executable, "-m", "nextoken", "serve", *rest, "--host", "127.0.0.1", "--port", str(port)]
            procs.append((f"replica {i} (port {port}, cores {','.join(map(str, cores))})",
                          subprocess.Popen(cmd, preexec_fn=_pin(cores))))
        if not _wait_replicas(procs, ports, stopping):
            return 0 if stopping["signal"] is not None else 1
        cmd = router_command(router, args.host, args.port, args.router_policy,
                             [f"http://127.0.0.1:{p}" for p in ports], args.port + args.replicas + 1)
        procs.append(("router", subprocess.Popen(cmd)))
        log.info("nextoken: %d replicas of %s behind vllm-router (%s) on http://%s:%d", args.replicas, args.model,
                 args.router_policy, args.host, args.port)
        return _supervise(procs, stopping, args)
    finally:
        _stop_all(procs, args.shutdown_timeout)
        for s, handler in old.items():
            signal.signal(s, handler)


def _pin(cores: list[int]):
    def pin():
        os.sched_setaffinity(0, cores)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us in order
    return pin


def _wait_replicas(procs, ports: list[int], stopping) -> bool:
    """Until every replica still running answers ``/health`` with 200. The router starts after:
    its start-up check then finds every replica healthy at once, where a replica still loading
    would wait for two of its periodic checks (10 s) before it takes requests. False on a
    signal or when every replica has exited (logged here)."""
    pending = dict(zip(ports, procs))
    while stopping["signal"] is None:
        for port, (_, p) in list(pending.items()):
            if p.poll() is not None or _healthy(f"http://127.0.0.1:{port}/health"):
                del pending[port]  # one that exited is logged by `_supervise`
        if not pending:
            if all(p.poll() is not None for _, p in procs):
                for name, p in procs:
                    log.warning("%s exited with status %s", name, p.returncode)
                log.error("every replica has exited; stopping")
                return False
            return True
        time.sleep(0.2)
    return False


def _supervise(procs, stopping, args) -> int:
    announced, alive = False, {name for name, _ in procs}
    while stopping["signal"] is None:
        for name, p in procs:
            if name in alive and p.poll() is not None:
                alive.discard(name)
                log.warning("%s exited with status %s", name, p.returncode)
        if "router" not in alive or alive == {"router"}:
            log.error("the router or every replica has exited; stopping")
            return 1
        if not announced and _healthy(f"http://{_connect_host(args.host)}:{args.port}/health"):
            announced = True
            log.info("nextoken serving %s on http://%s:%d (%d replicas)", args.model, args.host, args.port,
                     args.replicas)
        time.sleep(0.2)
    return 0


def _stop_all(procs, timeout: float) -> None:
    """SIGTERM to the router, then to the replicas; SIGKILL to what is left after `timeout`."""
    for _, p in reversed(procs):  # the router first: no new requests reach a draining replica
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout
    for _, p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _healthy(url: str) -> bool:
    import urllib.request

    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through a proxy
    try:
        with direct.open(url, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False
