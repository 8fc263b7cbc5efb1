"""What this CPU has, for tests whose expectations depend on it."""

from __future__ import annotations


def cpu_has(flag: str) -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and flag in line.split() for line in f)
