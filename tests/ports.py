"""Ports for the tests' servers, taken below the kernel's ephemeral range.

A port checked free inside the ephemeral range (32768-60999 by default) can be taken by an
outgoing connection before the server binds it: the router's and the clients' connections to the
replicas use such ports, and vllm-router then exited with "Address already in use".
"""

from __future__ import annotations

import os
import socket


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (ports it gives outgoing connections)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_next: dict[int, int] = {}  # n -> where this process's next search starts


def free_ports(n: int) -> int:
    """A base port B with B..B+n-1 all free on 127.0.0.1, below the kernel's ephemeral range: a
    port checked free there cannot be taken meanwhile by an outgoing connection (the router's and
    the clients' connections to the replicas use ephemeral ports).

    Each pytest-xdist worker searches a slice of its own (``PYTEST_XDIST_WORKER``), so two workers
    never hand out the same port, and each search starts after the port handed out last (a server
    may not have bound it yet)."""
    top = ephemeral_start() - n
    low = 20000 if top > 21000 else 1024
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    width = (top - low) // max(workers, 1)
    low, top = low + worker * width, low + (worker + 1) * width
    start = _next.get(n, low + os.getpid() % ((top - low) // n) * n)
    for base in [*range(start, top - n + 1, n), *range(low, start, n)]:
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            _next[n] = base + n if base + 2 * n <= top else low
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")
