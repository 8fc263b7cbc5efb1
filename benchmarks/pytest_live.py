"""A pytest plugin for benchmarks/gpu_check.py's test section (``-p pytest_live``): each failure's
report is appended to the file ``LIVE_FAILURES`` names as soon as it happens, so that a test run
the check's time limit cuts short still says which tests failed and why (pytest prints its
failures only at the end). With pytest-xdist the controller writes them, once."""

from __future__ import annotations

import os


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("LIVE_FAILURES")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a") as f:
        f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n\n")
