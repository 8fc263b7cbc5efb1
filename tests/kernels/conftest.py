"""Kernel tests split their work over two threads (`two_threads`): the suite's workers compute
with one thread each (tests/conftest.py), and the kernels' threaded partitions, reductions and
barriers must stay under test."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _two_threads(two_threads):
    pass
