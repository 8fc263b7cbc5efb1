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


def free_ports(n: int) -> int:
    """A base port B with B..B+n-1 all free on 127.0.0.1, below the kernel's ephemeral range: a
    port checked free there cannot be taken meanwhile by an outgoing connection (the router's and
    the clients' connections to the replicas use ephemeral ports)."""
    top = ephemeral_start() - n
    low = 20000 if top > 21000 else 1024
    start = low + os.getpid() % ((top - low) // n) * n
    for base in [*range(start, top, n), *range(low, start, n)]:
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")
